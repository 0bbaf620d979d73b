"""The engine loop: admit requests, schedule a step, run it, sample, and turn tokens into outputs.

Synchronous: plan s, launch s, read s's tokens, book-keep, plan s+1.
Asynchronous (DESIGN.md, "Async scheduling"): plan s+1 and launch it *before* reading s's tokens.
Each request that samples at s gets a PLACEHOLDER and its computed count advances at launch; the
runner copies the real value into s+1's inputs on the device. The one host sync per step (reading
s's tokens) then overlaps s+1's GPU work. A request that stopped at s has one wasted token in s+1,
dropped on resolve. Both modes share `_launch` and `_resolve`; only their order differs.

Requests in rows of the persistent batch are bound to them (row_state.py), so a decode step is
booked in bulk (row_booking.py): placeholders appended and sampled tokens resolved for every row
with numpy, and only the rows with an event (first token, stop token, length limit, text, logprobs)
or whose row was released since launch take the per-request path. An input batch without rows
(the benchmarks' per-step rebuild baseline) leaves the requests unbound and every step on the
per-request path.
"""

import dataclasses
import functools
import itertools
import numbers
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pcg_engine.kernels.argmax import argmax_rows, greedy_tokens, workspace_for
from pcg_engine.config import EngineConfig
from pcg_engine.engine import gc_freeze
from pcg_engine.engine.block_manager import BlockManager
from pcg_engine.engine.detokenizer import IncrementalDetokenizer
from pcg_engine.engine.model_runner import ModelRunner
from pcg_engine.engine.readback import TokenReadback
from pcg_engine.engine.request import PLACEHOLDER, Request, RequestStatus
from pcg_engine.engine.row_booking import Inflight, launch_rows, resolve_rows
from pcg_engine.engine.sampler import Sampler, SamplerOutput
from pcg_engine.engine.sampling_tensors import SamplingRow, SamplingTensors, make_generator
from pcg_engine.engine.scheduler import Scheduler, SchedulerConfig
from pcg_engine.engine.tokenizer import LazyTokenizer, eos_token_ids
from pcg_engine.errors import EngineClosedError, InvalidRequestError
from pcg_engine.models.model_config import read_config
from pcg_engine.outputs import RequestOutput, abandoned
from pcg_engine.sampling_params import SamplingParams, finite_float


@dataclass
class EngineStats:
    steps: int = 0
    preemptions: int = 0
    host_s: float = 0.0          # host time spent in step() outside the token read-back wait
    sync_wait_s: float = 0.0
    generated_tokens: int = 0


def _locked(method):
    """Run the engine method under the engine's lock (LLMEngine's docstring says why), counted in
    `_busy` while it runs: a request abandoned meanwhile by this very thread (the garbage collector
    closing a dropped stream in the middle of a step) is settled once the call is over (abandon)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.lock:
            self._busy += 1
            settled, result = False, None
            try:
                result = method(self, *args, **kwargs)
            finally:
                self._busy -= 1
                if self._abandon_later and not self._busy:
                    settled = True
                    try:
                        self._settle_abandoned()
                    except BaseException:
                        # (Ctrl-C in the settle) step()'s outputs go back to the engine, not lost
                        # with this frame: a bystander stream missed its token (found by a review)
                        if isinstance(result, list):
                            self.pending_outputs[:0] = [out for out in result if not abandoned(out)]
                        raise
            if settled and isinstance(result, list):     # step()'s outputs: none of theirs
                result = [out for out in result if not abandoned(out)]
            return result
    return locked


class LLMEngine:
    """The engine. Its methods may be called from several threads: each public call (add_request,
    abort_request, step, reset_prefix_cache, close, has_unfinished_requests) holds `lock`, so
    calls run one at a time, a step whole, and a call from another thread waits for it (LLM's
    generate holds the lock for its whole run, a stream for each of its steps). A server still
    does best with one thread that steps and others that hand it requests (bench/engine_thread.py):
    a client calling add_request while a step runs waits for that step."""

    def __init__(self, config: EngineConfig, progress=None):
        # Re-entrant: LLM.generate holds it around its steps, and its on_output callback may call
        # the engine from the same thread. Without it, two threads' steps (two generate() calls,
        # a stream beside a generate, add_request or close beside a step loop) interleaved on
        # shared state: IndexErrors deep in the forward, rows and blocks of aborted requests left
        # behind, outputs with the wrong tokens, a closed model stepped.
        self.lock = threading.RLock()
        self._busy = 0                          # engine calls under way in the lock's thread (_locked)
        self._abandon_later: list[str] = []     # abandoned during one of them (abandon)
        self.closed = False
        self.config = config
        self.device = torch.device(config.resolved_device())
        if config.model is None:
            from pcg_engine.models.checkpoint_maker import ensure_default_model
            self.model_path = Path(ensure_default_model())
        else:
            self.model_path = Path(config.model)
        model_config = read_config(self.model_path)    # first: names a missing or unreadable directory
        # Loaded on first use (engine/tokenizer.py): importing transformers is seconds of start-up,
        # and token-id prompts without detokenizing never need it.
        self.lazy_tokenizer = LazyTokenizer(self.model_path)
        # Before the weights: a broken generation_config.json fails the start in a moment, not after
        # the load, the compile and the capture.
        self.eos_token_ids = eos_token_ids(self.model_path, self.lazy_tokenizer, model_config.vocab_size)
        self.runner = ModelRunner(config, self.model_path, self.device, progress)
        self.vocab_size = self.runner.vocab_size
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   self.max_model_len), self.block_manager)
        self.sampling = SamplingTensors.empty(config.max_num_seqs, self.vocab_size, self.device)
        shared = torch.Generator(device=self.device)
        shared.manual_seed(config.seed)
        self.sampler = Sampler(shared)
        self.readback = TokenReadback(config.max_num_seqs, self.device)
        # The logits keep the model's dtype (Qwen3ForCausalLM.compute_logits): known here, not per step.
        self.argmax_workspace = workspace_for(config.max_num_seqs, self.vocab_size, self.device, self.runner.dtype)
        self._zero_copy = self.argmax_workspace is not None and self.readback.zero_copy
        self.async_scheduling = config.resolved_async(self.device.type)
        self.inflight: Inflight | None = None
        # Launched steps whose read-back an exception (Ctrl-C in the wait) stopped: the next step
        # reads them, in launch order, before planning anything (see step()).
        self.unresolved: list[Inflight] = []
        self._bound_in_launch: list[Request] = []   # the rows the last launch bound (_launch_failed)
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer | None] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.logprobs: dict[str, list] = {}
        self.pending_outputs: list[RequestOutput] = []
        self.stats = EngineStats()
        self._ids = itertools.count()
        # Rows whose sampling needs more than an argmax (temperature, penalties, min_tokens,
        # logprobs). While none is in the batch, sampling is one argmax kernel: at batch 256 the
        # full sampler's per-step gathers would cost more host time than the decode step.
        self._full_sampler_rows: set[int] = set()
        if config.gc_freeze:     # last: everything start-up made stays out of the collector's way
            t0 = time.perf_counter()
            self.runner.timings["gc_frozen_objects"] = float(gc_freeze.freeze())
            self.runner.timings["gc_freeze_s"] = time.perf_counter() - t0

    @property
    def tokenizer(self):
        return self.lazy_tokenizer.get()

    # ---- requests ----------------------------------------------------------------------------
    @_locked
    def add_request(self, prompt: str | list[int] | None = None, params: SamplingParams | dict | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    prompt_token_ids: list[int] | None = None, final_only: bool = False) -> str:
        """Validate and queue a request. Raises InvalidRequestError (naming the field) and adds nothing.

        final_only: step() returns this request's output only when it finishes (a caller that
        wants just the result, like LLM.generate without on_output, saves the per-step object)."""
        if self.closed:
            raise EngineClosedError("add_request")
        if not isinstance(final_only, bool):
            raise InvalidRequestError("final_only", f"must be true or false, got {final_only!r}")
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        elif isinstance(params, SamplingParams):
            # A copy, checked again: the caller may have changed a field since it was made (the
            # dataclass is mutable), and may change its object while this request runs.
            params = dataclasses.replace(params)
        else:
            raise InvalidRequestError("sampling_params", f"expected SamplingParams or dict, got {type(params).__name__}")
        if arrival_time is not None:
            t = finite_float(arrival_time)
            # Not in the future either: its metrics (TTFT, queue time) would come out negative.
            if t is None or t > time.monotonic():
                raise InvalidRequestError("arrival_time", f"must be a finite time.monotonic() value, not in the "
                                          f"future, or None; got {arrival_time!r}")
            arrival_time = t
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            # A caller's own id took it, or took it and finished with its final output still
            # waiting for the caller's next step(): reused, the output went to the new request's
            # owner (LLM.generate took it as its own) and its caller never saw it.
            pending = {o.request_id for o in self.pending_outputs}
            while request_id in self.requests or request_id in pending:
                request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            # Not str()'d: outputs carry the id as a string, so a caller matching them against its
            # int 5 (or an object) would never find its request's output.
            raise InvalidRequestError("request_id", f"must be a non-empty string, or None for an automatic id; "
                                      f"got {request_id!r}")
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use by an unfinished request")
        if any(o.request_id == request_id for o in self.pending_outputs):
            # Its final output (an abort's, say) is still to come from step(): taken, the caller got
            # two finished outputs under one id and took the first for the new request's end.
            raise InvalidRequestError("request_id", f"{request_id!r} is the id of a finished request whose final "
                                      "output step() has not returned yet; step() first, or use another id")
        if params.stop and not self.lazy_tokenizer.available:
            raise InvalidRequestError("stop", f"stop strings are matched on the output text, but "
                                      f"{self.lazy_tokenizer.missing()}; use stop_token_ids")
        ids = self._prompt_ids(prompt, prompt_token_ids)
        if params.truncate_prompt_tokens is not None and len(ids) > params.truncate_prompt_tokens:
            ids = ids[-params.truncate_prompt_tokens:]
        n, L = len(ids), self.max_model_len
        truncate = params.truncate_prompt_tokens
        if n >= L and truncate is not None:
            # The prompt was cut to truncate_prompt_tokens and is still too long: that setting is
            # what to change (the prompt_token_ids error said "or set truncate_prompt_tokens",
            # which was set).
            raise InvalidRequestError("truncate_prompt_tokens", f"{truncate} keeps {n} prompt tokens, max_model_len "
                                      f"is {L}; allowed: 1..{L - 1}")
        if n >= L:      # the prompt alone: no max_tokens would fit
            raise InvalidRequestError("prompt_token_ids", f"prompt has {n} tokens, max_model_len is {L}; allowed: at "
                                      f"most {L - 1} prompt tokens, to leave room for one new token (or set "
                                      "truncate_prompt_tokens to shorten the prompt)")
        if n + params.max_tokens > L:
            if truncate is None:
                hint = f"1..{L - n} (or set truncate_prompt_tokens to shorten the prompt)"
            elif params.max_tokens < L:   # already set: how far to lower it
                hint = f"1..{L - n} (or truncate_prompt_tokens 1..{L - params.max_tokens} to keep fewer prompt tokens)"
            else:
                hint = f"1..{L - n}"
            raise InvalidRequestError("max_tokens", f"prompt has {n} tokens and max_tokens is {params.max_tokens}, "
                                      f"beyond max_model_len {L}; max_tokens allowed: {hint}")
        params.validate_against_model(self.vocab_size)
        request = Request(request_id, ids, params, arrival_time=arrival_time,
                          eos_token_id=min(self.eos_token_ids) if self.eos_token_ids else None)
        # What _check_stop can end the request on, for _resolve's quick test (a superset: it
        # ignores min_tokens, so the full test still runs whenever one of these shows up). The
        # length limit, request.last_index, is set by the scheduler when it takes the request.
        request.stop_token_set = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(self.eos_token_ids))
        request.final_only = final_only
        if isinstance(prompt, str):
            request.prompt = prompt     # outputs carry it (RequestOutput.prompt), as given
        self.scheduler.check_request(request)
        # Everything that can still fail (loading the tokenizer, the seed's generator) before the
        # request is queued: a refusal leaves nothing behind.
        # Without a tokenizer there is no text: outputs carry token ids and an empty text.
        detok = (IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens, params.min_tokens)
                 if params.detokenize and self.lazy_tokenizer.available else None)
        generator = make_generator(params.seed, self.device) if params.seed is not None else None
        self.scheduler.add_request(request)
        self.requests[request_id] = request
        self.detokenizers[request_id] = detok
        if generator is not None:
            self.generators[request_id] = generator
        if params.logprobs is not None:
            self.logprobs[request_id] = []
        return request_id

    def _prompt_ids(self, prompt, prompt_token_ids) -> list[int]:
        if prompt is not None and prompt_token_ids is not None:
            raise InvalidRequestError("prompt", "give either prompt or prompt_token_ids, not both")
        for field, value in (("prompt", prompt), ("prompt_token_ids", prompt_token_ids)):
            # A memoryview has ndim and tolist: one of bytes was taken as token ids (b"hi" -> [104, 105]).
            if isinstance(value, memoryview):
                raise InvalidRequestError(field, "is a memoryview; give text as a str (decode bytes first) or "
                                          "token ids as a list, a 1-D numpy array or a tensor")
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                if prompt == "":
                    raise InvalidRequestError("prompt", "is empty; give at least one character or token")
                try:
                    prompt.encode("utf-8")
                except UnicodeEncodeError as e:    # a lone surrogate: the tokenizer would raise a TypeError
                    raise InvalidRequestError("prompt", f"is not valid Unicode text: {e.reason} at character "
                                              f"{e.start}") from None
                if not self.lazy_tokenizer.available:
                    raise InvalidRequestError("prompt", f"is text, but {self.lazy_tokenizer.missing()}; "
                                              "give token ids instead")
                # verbose=False: transformers warned "Token indices sequence length is longer than
                # the specified maximum" past the tokenizer's model_max_length, for a prompt the
                # engine then takes or refuses by its own max_model_len (or truncates as asked).
                prompt_token_ids = self.tokenizer(prompt, add_special_tokens=False, verbose=False)["input_ids"]
                beyond = max(prompt_token_ids, default=0)       # max: in C, not a per-token loop
                if beyond >= self.vocab_size:
                    # Not the caller's token ids: the checkpoint's tokenizer and config.json disagree,
                    # and "prompt_token_ids: token ... outside the vocabulary" blamed ids never given.
                    raise InvalidRequestError("prompt", f"the text encodes to token {beyond}, beyond the model's "
                                              f"vocabulary 0..{self.vocab_size - 1} (config.json's vocab_size): "
                                              f"the tokenizer of {self.model_path} holds {len(self.tokenizer)} "
                                              "tokens, more than the model; the tokenizer and config.json are "
                                              "not of the same model")
            elif isinstance(prompt, (list, tuple)):
                prompt_token_ids = prompt
            elif getattr(prompt, "ndim", None) == 1 and hasattr(prompt, "tolist"):
                prompt_token_ids = prompt.tolist()     # a numpy array or tensor of ids (floats stay floats: refused)
            else:
                raise InvalidRequestError("prompt", f"expected a string or a list of token ids, got {type(prompt).__name__}")
        elif getattr(prompt_token_ids, "ndim", None) == 1 and hasattr(prompt_token_ids, "tolist"):
            prompt_token_ids = prompt_token_ids.tolist()
        elif not isinstance(prompt_token_ids, (list, tuple)):
            # What prompt= takes as ids, no more: list() took a dict's keys and a set in hash
            # order, read a string as a list of text prompts, and raised a bare TypeError on an int.
            hint = "; give text as prompt" if isinstance(prompt_token_ids, str) else ""
            raise InvalidRequestError("prompt_token_ids", "must be a list of token ids (or a 1-D array or tensor), "
                                      f"got {type(prompt_token_ids).__name__}{hint}")
        ids = list(prompt_token_ids)
        if not ids:
            raise InvalidRequestError("prompt_token_ids", "is empty; a request needs at least 1 token")
        # The common case in C: all plain ints, in range (P2's 256 prompts of ~560 tokens took
        # 0.18 s in the per-token loop below on the CPU machine). Anything else takes the loop,
        # which names the first bad token.
        if set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < self.vocab_size:
            return ids
        for i, t in enumerate(ids):
            if isinstance(t, str) and all(isinstance(x, str) for x in ids):
                # Several text prompts, where one request takes one (LLM.stream, add_request).
                raise InvalidRequestError("prompt", f"is a list of {len(ids)} strings; one request takes one "
                                          "prompt, a string or a list of token ids (LLM.generate takes a list "
                                          "of prompts)")
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise InvalidRequestError("prompt_token_ids", f"token {t!r} at position {i} is not an integer; "
                                          f"allowed: integers 0..{self.vocab_size - 1}")
            if not 0 <= t < self.vocab_size:
                raise InvalidRequestError("prompt_token_ids", f"token {t!r} at position {i} is outside the "
                                          f"vocabulary; allowed: integers 0..{self.vocab_size - 1}")
        return [int(t) for t in ids]                 # numpy integers as plain ints

    @_locked
    def abort_request(self, request_id: str, missing_ok: bool = False) -> bool:
        """Finish the request as aborted (its final output comes from the next step()); True.
        An id that is not an unfinished request is refused, or with missing_ok returns False: a
        server aborting on a client's disconnect races the thread that steps the engine, and the
        request may have finished in between (the engine keeps no record of finished ids, so it
        cannot tell that from a mistyped one)."""
        if self.closed:     # close() dropped every request: not "not a request of this engine"
            raise EngineClosedError("abort_request")
        if not isinstance(request_id, str):
            # add_request takes string ids only: str(5) would abort a request named "5".
            raise InvalidRequestError("request_id", f"must be a string (an id add_request returned), "
                                      f"got {request_id!r}")
        request = self.requests.get(request_id)
        if request is None:
            if missing_ok:
                return False
            raise InvalidRequestError("request_id", f"{request_id!r} is not an unfinished request of this engine "
                                      "(abort_request(..., missing_ok=True) returns False for it)")
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
        self._forget(request)
        # The text held back (the start of a possible stop string, a split character) is the end
        # of this text now, as at any other finish: without the flush the final text left out text
        # of tokens its token_ids held (found by a review).
        detok = self.detokenizers.get(request_id)
        delta = detok.flush() if detok is not None and detok.stopped_by is None else ""
        self.pending_outputs.append(self._output(request, [], delta))
        return True

    def abandon(self, request_ids) -> None:
        """Abort those of request_ids still unfinished and drop their outputs, for a caller that
        no longer wants them (a stream closed or collected, an interrupted generate). Not stepping:
        that would run (and swallow the outputs of) other requests in flight.

        Called while an engine call of this same thread is under way, it is done when that call
        ends. That happens when the garbage collector closes a dropped stream (one caught in a
        reference cycle) in the middle of another caller's step: aborted there, inside the
        scheduling or the forward, the request left its row bound to nobody (the batch was then
        full for good) and its outputs went round between callers for ever (found by a review)."""
        with self.lock:
            self._abandon_later += request_ids
            if not self._busy:
                self._settle_abandoned()

    def _settle_abandoned(self) -> None:
        self._busy += 1           # a collection meanwhile adds to the list; this loop takes it
        try:
            while self._abandon_later:
                # One id at a time, taken off the list once done: a stop in here (Ctrl-C) leaves
                # the rest listed for the next call, not never aborted (found by a review).
                rid = self._abandon_later[0]
                request = self.requests.get(rid)
                if request is not None:
                    request.abandoned = True      # its outputs are nobody's (outputs.abandoned)
                    try:
                        self.abort_request(rid)
                    except Exception:   # pragma: no cover - the engine already failed; keep its error
                        pass
                self.pending_outputs = [o for o in self.pending_outputs
                                        if o.request_id != rid and not abandoned(o)]
                del self._abandon_later[0]
        finally:
            self._busy -= 1

    @_locked
    def close(self) -> None:
        """Drop every request and release the device memory (see ModelRunner.close). The engine
        cannot be used afterwards (add_request and step raise EngineClosedError). Called from
        another thread while a step or LLM.generate runs there, it waits for that to end."""
        self.closed = True
        self.inflight = None
        self.unresolved = []
        self.requests.clear()
        self.pending_outputs = []
        self.sampling = None
        gc_freeze.unfreeze()    # whoever froze them: the runner's collection must see the engine's cycles
        self.runner.close()

    @_locked
    def has_unfinished_requests(self) -> bool:
        self._settle_orphaned_step()
        return (bool(self.requests) or self.inflight is not None or bool(self.pending_outputs)
                or bool(self.unresolved))

    def _settle_orphaned_step(self) -> None:
        """Async: a step still in flight whose requests have all gone (an abandoned stream, an
        interrupted generate() abort theirs and do not step). Nothing of it is left to read:
        settled here, its tokens dropped as a step would, rather than have an engine where no
        request runs report unfinished work (has_unfinished_requests() said True until one more
        step()) or refuse reset_prefix_cache() (the load test then refused its measured run)."""
        if self.inflight is not None and not self.requests and not self.unresolved:
            inflight, self.inflight = self.inflight, None
            self.pending_outputs += self._resolve(inflight)     # nothing: every request finished

    @_locked
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (BlockManager.reset_prefix_cache), so the next request
        finds none: a benchmark's measured run then starts cold, whatever ran before. Only on an
        idle engine; returns False, changing nothing, while a request runs. An output still waiting
        for step() (an aborted request's, a finished one's) holds no block and does not count: it
        did, and an engine whose caller had just aborted everything answered False."""
        if self.closed:
            raise EngineClosedError("reset_prefix_cache")
        self._settle_orphaned_step()
        if self.requests or self.inflight is not None or self.unresolved:
            return False
        return self.block_manager.reset_prefix_cache()

    # ---- steps -------------------------------------------------------------------------------
    @_locked  # uncontended: ~0.1 us a call (a step is ~200 us of host time at batch 256)
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns outputs of requests that got tokens or finished."""
        if self.closed:
            raise EngineClosedError("step")
        if self.unresolved:
            return self._resolve_interrupted()
        t0 = time.perf_counter()
        wait0 = self.stats.sync_wait_s
        plan = self.scheduler.schedule()
        # The victims' rows go before anything launches, and also when nothing does: a request
        # that preempted itself with nobody else to run leaves an empty plan, and its stale row
        # (block table, token count) would otherwise be taken up again when it is re-admitted.
        self._release_preempted(plan.preempted)
        try:
            launched = self._launch(plan) if not plan.is_empty else None
        except BaseException:
            self._launch_failed()
            raise
        outputs, self.pending_outputs = self.pending_outputs, []
        try:
            if self.async_scheduling:
                if self.inflight is not None:
                    outputs += self._resolve(self.inflight)
                self.inflight = launched
                if launched is not None and not self.requests:
                    # The read-back finished every request of the step just launched: nothing will
                    # use its tokens. Read it now, on an engine with nothing left to run, so that
                    # has_unfinished_requests() is False when generate() or a stream returns, not
                    # one idle step() later (a wait of at most that step's GPU time).
                    self.inflight = None
                    outputs += self._resolve(launched)
            elif launched is not None:
                outputs += self._resolve(launched)
        except BaseException:
            # Stopped while reading tokens back (Ctrl-C in the wait, under generate() or stream()):
            # the launched steps were lost with this frame, and every request in them kept a
            # placeholder that no step would resolve: a request another caller had added ran on
            # with it (its output carried the placeholder) or never finished. Keep them for the
            # next step, and the outputs this one took.
            self.unresolved = [s for s in (self.inflight if self.async_scheduling else None, launched)
                               if s is not None]
            self.inflight = None
            self.pending_outputs[:0] = outputs
            raise
        self.stats.host_s += time.perf_counter() - t0 - (self.stats.sync_wait_s - wait0)
        return outputs

    def _launch_failed(self) -> None:
        """A step stopped before it was launched whole (in its forward or sampling: Ctrl-C, out of
        memory, a bug) counts as not launched, and its requests are planned again (_launch). But its
        inputs were already prepared: the input batch had rewritten where each row's token sits in
        the step's output, and the next step filled its placeholder inputs from the step in flight
        by that layout, a neighbour's token when the rows had changed (found by a review). The step
        in flight is resolved first, as after a stop in the read-back, so that the next launch has
        no placeholder input to fill; and the batch sends all its inputs again (a stop between
        staging the block table and its copy would leave the device's copy behind).

        The rows this launch bound are released, to be bound again by the next launch: a stop
        between binding a row and writing its sampling row left the row bound, so no later launch
        wrote it, and a request with a temperature or a seed ran on greedy (found by a review).
        The step in flight is moved first, in one statement: a second stop in here left it in
        flight, and the next launch fed a neighbour's token again (found by the same review)."""
        if self.async_scheduling and self.inflight is not None:
            self.unresolved, self.inflight = [self.inflight], None
        try:
            for request in self._bound_in_launch:
                self._release_row(request)
        finally:
            self.runner.batch.invalidate()

    def _resolve_interrupted(self) -> list[RequestOutput]:
        """The step after one stopped in its read-back: read the steps it launched, oldest first
        (their tokens are the inputs of what follows), and plan nothing; the next step goes on."""
        outputs, self.pending_outputs = self.pending_outputs, []
        while self.unresolved:
            try:
                resolved = self._resolve(self.unresolved[0])
            except BaseException:
                self.pending_outputs[:0] = outputs
                raise
            del self.unresolved[0]
            outputs += resolved
        return outputs

    def _release_preempted(self, victims) -> None:
        self.stats.preemptions += len(victims)
        for victim in victims:
            self._release_row(victim)

    def _launch(self, plan) -> Inflight:
        self._bound_in_launch = bound = []      # released again if this launch fails (_launch_failed)
        batch = self.runner.batch
        row_of = batch.row_of
        state = getattr(batch, "state", None)
        # The decode fast path (scheduled.rows) schedules only requests that hold rows already.
        for request, _ in (plan.scheduled if getattr(plan.scheduled, "rows", None) is None else ()):
            rid = request.request_id
            if rid not in row_of:
                bound.append(request)
                row = batch.add(request)
                if state is not None:
                    self._describe_row(state, row, request)
                p = request.sampling_params
                outputs = [t for t in request.output_token_ids if t != PLACEHOLDER]
                self.sampling.write_rows([row], [SamplingRow(
                    p, outputs, request.prompt_token_ids, self.generators.get(rid),
                    None if p.ignore_eos else sorted(self.eos_token_ids))])
                if not _plain_greedy(p):
                    self._full_sampler_rows.add(row)
        batch.sync_rows(plan.scheduled, self.block_manager.block_table)
        previous = self.inflight.sampled.token_ids if self.inflight is not None else None
        logits, inputs = self.runner.execute(plan.scheduled, previous_tokens=previous)
        rows = streams = None
        counted = False
        try:
            if self._full_sampler_rows:
                rows = [batch.row_of[r.request_id] for r in inputs.sample_rows]
                selected = self.sampling.select(rows)
                # The seeded rows' streams as they were: a step that fails from here on draws again
                # from them when it is planned again (else a seeded request's tokens depended on an
                # interruption; found by a review).
                streams = [(g, g.get_state()) for g in map(selected.generators.__getitem__, selected.seeded_rows)]
                sampled = self.sampler(logits, selected)
                pending = self.readback.start(sampled)
            elif self._zero_copy:
                # kernels/argmax.py writes the tokens into the read-back's pinned buffer too: no copy.
                i, host, address = self.readback.claim(logits.shape[0])
                # kept_out: the workspace's two output buffers in turn (the next step reads these tokens).
                sampled = SamplerOutput(token_ids=argmax_rows(logits, self.argmax_workspace, host, address,
                                                              kept_out=True))
                pending = self.readback.written(i, host)
            else:
                sampled = SamplerOutput(token_ids=greedy_tokens(logits, self.argmax_workspace))   # kernels/argmax.py
                pending = self.readback.start(sampled)
            # After the sampling, which can raise (an error in a sampler, Ctrl-C, out of memory): the
            # computed counts advance only with the placeholders that follow at once. Advanced before
            # it, a raise left every request of the step counted as computed with no token coming,
            # never scheduled again and holding its blocks (another caller's request, when generate()
            # was the one stopped). Now the step is as if not launched: its requests are planned again.
            if rows is not None:
                # Counted (penalties, min_tokens) here and taken back if the step fails: counted
                # for a step planned again, each of its rows ran one token ahead, penalised twice
                # for it, its min_tokens mask lifted a token early; counted after the scheduler's
                # update, a stop in between left the step counted as computed with no token to
                # come, its request never scheduled again (both found by reviews).
                self.sampling.record_sampled(sampled.token_ids, rows)
                counted = True
            self.scheduler.update_after_step(plan.scheduled)
        except BaseException:
            if counted:
                self.sampling.record_sampled(sampled.token_ids, rows, count=-1)
            for generator, state in streams or ():
                generator.set_state(state)
            raise
        self.stats.steps += 1
        if state is not None and getattr(inputs, "sample_row_ids", None) is not None:
            return launch_rows(state, plan.scheduled, inputs, sampled, pending, self.async_scheduling)
        slots = []
        for request in inputs.sample_rows:
            tokens = request.token_ids
            slots.append((request, len(tokens)))
            tokens.append(PLACEHOLDER)            # Request.append_output, inlined: runs per request per step
            request.num_placeholders += 1
        batch.write_placeholders(slots)
        return Inflight(sampled, pending, slots)

    def _describe_row(self, state, row: int, request: Request) -> None:
        """What the bulk booking of a freshly bound row needs to know of its request."""
        rid = request.request_id
        plain = self.detokenizers.get(rid) is None and rid not in self.logprobs
        state.describe(row, plain, not request.final_only, not plain or request.first_token_time is None,
                       request.stop_token_set)

    def _resolve(self, inflight: Inflight) -> list[RequestOutput]:
        w0 = time.perf_counter()
        if inflight.rows is not None:
            values = self.readback.wait_array(inflight.pending)   # the one host sync of a step
            self.stats.sync_wait_s += time.perf_counter() - w0
            return resolve_rows(self, inflight, values)
        values = self.readback.wait(inflight.pending)   # the one host sync of a step
        self.stats.sync_wait_s += time.perf_counter() - w0
        lps = self._logprob_lists(inflight.pending)
        now = time.monotonic()
        outputs = []
        resolved = []                          # (request id, index, token): into the rows in one go
        cache_full_blocks, bs = self.block_manager.cache_full_blocks, self.block_manager.block_size
        detokenizers, logprobs = self.detokenizers, self.logprobs
        generated = 0
        # This loop runs for every request every step (256 times a step at batch 256): plain
        # attribute reads, bound methods hoisted above, the common case (no text, no logprobs,
        # not stopping) without a call, and the rows' writes batched after the loop.
        for i, ((request, index), token) in enumerate(zip(inflight.slots, values)):
            tokens = request.token_ids
            if ((request.status is not _RUNNING and request.is_finished)
                    or index >= len(tokens) or tokens[index] != PLACEHOLDER):
                continue     # stopped or aborted while this step ran: its token is dropped
            tokens[index] = token
            request.num_placeholders -= 1
            rid = request.request_id
            resolved.append((rid, index, token))
            generated += 1
            if request.first_token_time is None:
                request.first_token_time = now
            if lps is not None and rid in logprobs:
                logprobs[rid].append(lps(i, token, request.sampling_params.logprobs))
            detok = detokenizers.get(rid)
            if detok is None and index < request.last_index and token not in request.stop_token_set:
                # A block that this placeholder kept out of the prefix cache may be publishable.
                if index // bs < request.num_computed_tokens // bs:
                    cache_full_blocks(request)
                if request.final_only:
                    continue
                outputs.append(RequestOutput(request, len(tokens) - request.num_placeholders, "", False, [token],
                                             "", logprobs.get(rid)))
                continue
            output = self._book_tail(request, index, token, detok)
            if output is not None:
                outputs.append(output)
        self.runner.batch.set_tokens(resolved)
        self.stats.generated_tokens += generated
        return outputs

    def _book_tail(self, request: Request, index: int, token: int, detok) -> RequestOutput | None:
        """The per-request booking of a resolved token: text, stop checks, finishing, output."""
        # A token that stops the request (EOS, stop_token_ids: stop_token_set, once min_tokens is
        # reached) is left out of the text, as a stop string is and as vLLM leaves it out
        # (include_stop_str_in_output=False): its text (" s", or "<|im_end|>" when special tokens
        # are kept) ended the output.
        stops = (token in request.stop_token_set
                 and index + 1 - len(request.prompt_token_ids) >= request.sampling_params.min_tokens)
        delta = detok.add(token) if detok is not None and not stops else ""
        status, reason = self._check_stop(request, index, token, detok)
        if status is not None:
            request.truncate(index + 1)   # drop the next step's speculative placeholder, if any
            if detok is not None and detok.stopped_by is None:
                delta += detok.flush()
                if detok.stopped_by is not None:
                    # A stop string only the end's text completes (one holding U+FFFD, which a
                    # character split at the end decodes to): the text is cut there, so say so.
                    status, reason = RequestStatus.FINISHED_STOPPED, detok.stopped_by
            self.scheduler.finish_request(request, status, reason)
            self._forget(request)
        else:
            self.block_manager.cache_full_blocks(request)
            if request.final_only:
                return None
        return self._output(request, [token], delta)

    def _check_stop(self, request: Request, index: int, token: int, detok):
        p = request.sampling_params
        num_out = index + 1 - len(request.prompt_token_ids)
        if not p.ignore_eos and token in self.eos_token_ids and num_out >= p.min_tokens:
            return RequestStatus.FINISHED_STOPPED, None
        if token in p.stop_token_ids and num_out >= p.min_tokens:
            return RequestStatus.FINISHED_STOPPED, token
        if detok is not None and detok.stopped_by is not None:
            return RequestStatus.FINISHED_STOPPED, detok.stopped_by
        if num_out >= p.max_tokens or index + 1 >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    def _logprob_lists(self, sampled):
        if sampled.logprobs is None:
            return None
        chosen = sampled.logprobs.tolist()
        top_ids = sampled.top_ids.tolist() if sampled.top_ids is not None else None
        top_lps = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None

        def entry(i, token, n):
            top = list(zip(top_ids[i][:n], top_lps[i][:n])) if top_ids is not None and n else []
            return {"token": token, "logprob": chosen[i], "top": top}
        return entry

    def _release_row(self, request: Request) -> None:
        row = self.runner.batch.row_of.get(request.request_id)
        if row is not None:
            self.sampling.clear_rows([row])
            self._full_sampler_rows.discard(row)
            self.runner.batch.remove(request.request_id)

    def _forget(self, request: Request) -> None:
        self._release_row(request)
        self.requests.pop(request.request_id, None)
        self.generators.pop(request.request_id, None)

    def _output(self, request: Request, new_tokens: list[int], delta: str) -> RequestOutput:
        rid = request.request_id
        if request.status is not _RUNNING and request.is_finished:
            detok = self.detokenizers.pop(rid, None)
            logprobs = self.logprobs.pop(rid, None)
            finished = True
        else:
            detok = self.detokenizers.get(rid)
            logprobs = self.logprobs.get(rid)
            finished = False
        # Placeholders only ever trail the real tokens.
        return RequestOutput(request, request.num_tokens - request.num_placeholders,
                             detok.text if detok is not None else "", finished, new_tokens, delta, logprobs)


_RUNNING = RequestStatus.RUNNING


def _plain_greedy(p: SamplingParams) -> bool:
    """Sampling that is exactly an argmax of the raw logits (min_tokens 0, no penalties, no logprobs)."""
    return (p.greedy and p.logprobs is None and p.min_tokens == 0 and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0)
