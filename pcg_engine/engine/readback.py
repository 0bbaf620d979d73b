"""Reading a step's sampled tokens back to the host without waiting for the step after it.

With async scheduling the engine launches step s+1 before it reads step s's tokens. A plain
`tensor.tolist()` on the device tensor would enqueue its copy behind everything on the stream, step
s+1 included, and wait for all of it: the host would then block for two steps' GPU work and the
overlap would be lost (seen on the H200 profile: the async timeline had the sync one's idle gaps).
So the copy is enqueued right after step s's sampling, into pinned host memory, with an event
behind it; reading back waits on that event alone.

Two pinned buffers (and two events) are used alternately: step s+1's copy must not overwrite the
buffer that step s's read-back has not consumed yet, and at most two steps are in flight. Their
views per row count are kept, so a step slices nothing.

Greedy steps need no copy at all: the argmax kernel writes the tokens into the pinned buffer
itself (`claim`, then `written` records the event behind the kernel). The copy's `Tensor.copy_`
was ~15-20 µs of a 256-row step's host time on the H200's host (session 24's P4 parts). A kernel
reaches pinned memory at the address the driver gives (argmax.pinned_address), asked once per
buffer; where it cannot be asked, `zero_copy` is False and every step copies.
PCG_ZERO_COPY_READBACK=0 turns it off (an A/B switch, read at construction).
"""

import os
from dataclasses import dataclass

import numpy as np
import torch

from pcg_engine.kernels.argmax import pinned_address


@dataclass
class PendingTokens:
    """One step's sampled values on their way to the host."""

    token_ids: torch.Tensor                       # [R] on the host once `event` has passed
    logprobs: torch.Tensor | None = None          # host copies of the optional logprob fields
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    event: "torch.cuda.Event | None" = None        # None on the CPU: the values are ready


class TokenReadback:
    def __init__(self, max_rows: int, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._buffers = [torch.empty(max_rows, dtype=torch.long, pin_memory=True) for _ in range(2)]
            self._events = [torch.cuda.Event() for _ in range(2)]
            self._views: list[dict] = [{}, {}]
            self._flip = 0
            # Event.record() without a stream builds a torch.cuda.Stream object per call (~10 µs on
            # the H200's host, most of the read-back's share of P4's profile): the current stream's
            # object is cached by its raw handle instead, so a side stream still gets its own.
            self._index = device.index if device.index is not None else torch.cuda.current_device()
            self._streams: dict[int, torch.cuda.Stream] = {}
            self._addresses = [pinned_address(b) for b in self._buffers]
        self.zero_copy = (self.cuda and None not in self._addresses
                          and os.environ.get("PCG_ZERO_COPY_READBACK", "1") != "0")

    def __del__(self):
        # The argmax kernel writes the pinned buffers behind the host allocator's back (it keeps a
        # freed pinned block from reuse only until the copies it saw are done): wait for the last
        # writes before the buffers go back to it. (Closing the engine synchronizes the device
        # first anyway; this covers an engine dropped with a step in flight.)
        if getattr(self, "zero_copy", False):
            try:
                for event in self._events:
                    event.synchronize()
            except Exception:       # interpreter shutdown: CUDA may be gone, and nothing is reused
                pass

    def claim(self, n: int) -> tuple[int, torch.Tensor, int]:
        """The next pinned buffer's first n entries, for a kernel to write a step's n tokens into:
        (its set, the view, the address a kernel writes it at). Pass the set and view to
        written() once that kernel is launched. CUDA only."""
        i = self._flip
        self._flip ^= 1
        buf = self._views[i].get(n)
        if buf is None:
            with torch.inference_mode(False):    # usable in and out of inference mode
                buf = self._views[i][n] = self._buffers[i][:n]
        return i, buf, self._addresses[i]

    def written(self, i: int, buf: torch.Tensor) -> PendingTokens:
        """claim()'s buffer, written by a kernel just launched on the current stream: its event."""
        return self._recorded(PendingTokens(buf, event=self._events[i]))

    def _recorded(self, pending: PendingTokens) -> PendingTokens:
        """pending, its event recorded on the current stream behind what was enqueued so far."""
        raw = torch._C._cuda_getCurrentRawStream(self._index)
        stream = self._streams.get(raw)
        if stream is None:
            stream = self._streams[raw] = torch.cuda.current_stream(self.device)
        pending.event.record(stream)
        return pending

    def start(self, sampled) -> PendingTokens:
        """Enqueue the copies of `sampled` (a SamplerOutput) right behind the kernels that made it."""
        if not self.cuda:
            return PendingTokens(sampled.token_ids, sampled.logprobs, sampled.top_ids, sampled.top_logprobs)
        i, buf, _ = self.claim(sampled.token_ids.shape[0])
        buf.copy_(sampled.token_ids, non_blocking=True)
        if sampled.logprobs is None and sampled.top_ids is None and sampled.top_logprobs is None:
            return self.written(i, buf)

        def host(t):   # rare (logprobs asked): a fresh pinned tensor, same ordering guarantee
            return None if t is None else t.to("cpu", non_blocking=True)
        return self._recorded(PendingTokens(buf, host(sampled.logprobs), host(sampled.top_ids),
                                            host(sampled.top_logprobs), self._events[i]))

    @staticmethod
    def wait(pending: PendingTokens) -> list[int]:
        """Block until this step's values are on the host (not any later step); its token ids."""
        if pending.event is not None:
            pending.event.synchronize()
        return pending.token_ids.tolist()

    @staticmethod
    def wait_array(pending: PendingTokens) -> np.ndarray:
        """wait(), the token ids as a numpy array of their own (the pinned buffer is reused)."""
        if pending.event is not None:
            pending.event.synchronize()
        return pending.token_ids.numpy().copy()
