"""Read safetensors shards into preallocated tensors with large sequential reads, not mmap.

safetensors' `safe_open` maps the file and copies each tensor out of the mapping: every 4 KiB page
is a page fault, costly in a VM and more so under gVisor (the H200 machine), and on CUDA each tensor
then goes through a pageable host copy. Here plain `readinto` calls fill the destinations: on
the CPU each tensor is read straight into its memory (Qwen3-0.6B's 1.2 GB on the development VM:
0.4-1.0 s against 1.7-2.9 s through safe_open); for a GPU the shard is read front to back in
CHUNK-sized pieces into two pinned buffers, and each piece's bytes are copied asynchronously into
the tensors it overlaps while the next piece is read into the other buffer.

The format is documented and small: 8 bytes little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data
(offsets relative to its start). Nothing in the file is executed; every offset and size is checked
against the file before a byte is copied, and errors name the file and tensor.
"""

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from pcg_engine.errors import CheckpointError
from pcg_engine.models.json_file import beyond_json_limits
from pcg_engine.models.regular_file import open_regular

CHUNK = 64 << 20
_MAX_HEADER = 100 << 20      # safetensors' own limit
DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
          "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
          "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple
    begin: int           # absolute byte offsets in the file
    end: int


class _Object(dict):
    """A JSON object that keeps the keys it was given more than once: json.loads alone keeps the
    last value of a repeated key, so a header naming a tensor twice would load one of them silently."""

    def __init__(self, pairs):
        super().__init__(pairs)
        seen = set()
        self.repeated = [k for k, _ in pairs if k in seen or seen.add(k)]


def read_header(path: Path) -> list[Entry]:
    """The tensors of a shard in file order, validated against the file's size."""
    path = Path(path)
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: not a safetensors file (header length {n} for a {size}-byte file)")
            header = json.loads(f.read(n), object_pairs_hook=_Object)
    except CheckpointError:         # a ValueError, raised above: not json's
        raise
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: invalid safetensors header ({e})") from None
    except (RecursionError, ValueError) as e:
        raise CheckpointError(f"{path}: invalid safetensors header ({beyond_json_limits(e)})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: invalid safetensors header (not a JSON object)")
    if header.repeated:
        raise CheckpointError(f"{path}: the safetensors header names tensor {header.repeated[0]!r} more than once; "
                              "a shard holds each tensor once (which entry is meant cannot be told)")
    start = 8 + n
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if isinstance(info, _Object) and info.repeated:
            raise CheckpointError(f"{path}: tensor {name!r}: its header entry gives {info.repeated[0]!r} more "
                                  "than once")
        try:
            dtype = DTYPES[info["dtype"]]
        except (KeyError, TypeError):
            if isinstance(info, dict) and isinstance(info.get("dtype"), str):
                # A dtype safetensors has but this reader does not load (F8_E8M0, U16, ...): say so,
                # not "invalid header entry", which reads as a damaged file.
                raise CheckpointError(f"{path}: tensor {name!r} has dtype {info['dtype']!r}, which this engine "
                                      f"does not load; allowed: {', '.join(DTYPES)}") from None
            raise CheckpointError(f"{path}: tensor {name!r} has an invalid header entry {info!r}") from None
        try:
            # A list, not any iterable: tuple("16") is ('1', '6'), and math.prod of it a TypeError.
            if not isinstance(info["shape"], list):
                raise TypeError
            shape = tuple(info["shape"])
            begin, end = info["data_offsets"]
            # Not bools: True is an int to Python, and a shape [16, true] would load as [16, 1].
            ok = all(_count(d) for d in shape) and _count(begin) and _count(end)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has an invalid header entry {info!r}") from None
        if not ok or not begin <= end or end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {[begin, end]} do not hold "
                                  f"{info['dtype']} {list(shape)}")
        if start + end > size:
            raise CheckpointError(f"{path}: tensor {name!r} ends at byte {start + end}, beyond the file's "
                                  f"{size} bytes (truncated?)")
        entries.append(Entry(name, dtype, shape, start + begin, start + end))
    entries.sort(key=lambda e: (e.begin, e.end))
    # Two tensors sharing bytes would both be filled from them, one's values in the other's place
    # (safetensors refuses such a file too). Empty tensors hold no bytes and overlap nothing.
    last = None
    for entry in entries:
        if entry.end == entry.begin:
            continue
        if last is not None and entry.begin < last.end:
            raise CheckpointError(f"{path}: tensors {last.name!r} (data bytes {last.begin - start}..{last.end - start}) "
                                  f"and {entry.name!r} (data bytes {entry.begin - start}..{entry.end - start}) overlap; "
                                  "each tensor has bytes of its own")
        if last is None or entry.end > last.end:
            last = entry
    # Bytes no tensor holds, between tensors or after the last: safetensors refuses such a file
    # ("invalid offset", "file not fully covered"), so transformers would not load what this
    # reader took, and the bytes may be a tensor the header lost (a damaged or mis-assembled shard).
    pos = start
    for entry in entries:
        if entry.begin > pos:
            raise CheckpointError(f"{path}: data bytes {pos - start}..{entry.begin - start} belong to no tensor "
                                  f"(before {entry.name!r}); a safetensors file's tensors cover its data without "
                                  "holes")
        pos = max(pos, entry.end)
    if pos != size:
        raise CheckpointError(f"{path}: {size - pos} bytes after the last tensor's data (which ends at byte {pos}); "
                              "a safetensors file ends with its last tensor (damaged or appended to?)")
    return entries


def _count(v) -> bool:
    """A header's size or offset: an int >= 0 (not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _bytes(t: torch.Tensor):
    """A writable buffer over a contiguous host tensor's bytes."""
    return memoryview(t.view(-1).view(torch.uint8).numpy())


def _read_exact(f, offset: int, view: memoryview, path) -> None:
    f.seek(offset)
    got = 0
    while got < len(view):
        k = f.readinto(view[got:])
        if not k:
            raise CheckpointError(f"{path}: unexpected end of file at byte {offset + got}")
        got += k


class _Sink:
    """Where one tensor's bytes go as the chunks pass: straight into the destination when it is a
    contiguous tensor of the file's dtype, else gathered on the host and converted at the end."""

    def __init__(self, entry: Entry, dest: torch.Tensor):
        self.entry, self.dest = entry, dest
        self.direct = dest.dtype == entry.dtype and dest.is_contiguous()
        self.bytes = dest.view(-1).view(torch.uint8) if self.direct else torch.empty(entry.end - entry.begin,
                                                                                     dtype=torch.uint8)

    def take(self, buffer: torch.Tensor, buffer_start: int, lo: int, hi: int) -> None:
        """Copy file bytes [lo, hi) held in `buffer` (which starts at file offset buffer_start)."""
        src = buffer[lo - buffer_start: hi - buffer_start]
        self.bytes[lo - self.entry.begin: hi - self.entry.begin].copy_(src, non_blocking=self.direct)
        if not self.direct and hi == self.entry.end:
            self.dest.copy_(self.bytes.view(self.entry.dtype).view(self.entry.shape))


def _read_to_host(f, path, targets) -> None:
    """CPU destinations: each tensor read straight into its memory (converted if dtypes differ)."""
    for entry, dest in targets:
        direct = dest.dtype == entry.dtype and dest.is_contiguous()
        host = dest if direct else torch.empty(entry.shape, dtype=entry.dtype)
        if entry.end > entry.begin:
            _read_exact(f, entry.begin, _bytes(host), path)
        if not direct:
            dest.copy_(host)


def _stream(f, path, targets, chunk: int, cuda: bool) -> None:
    """GPU destinations: the file read in chunks into two pinned buffers, each chunk's bytes copied
    asynchronously to the tensors it overlaps while the next chunk is read into the other buffer.
    (cuda=False runs the same walk with plain buffers and synchronous copies: the CPU tests.)"""
    buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
    events = [None, None]
    sinks = [_Sink(e, d) for e, d in targets]
    pos, end_all, first, which = sinks[0].entry.begin, max(s.entry.end for s in sinks), 0, 0
    while pos < end_all:
        # Skip file regions no remaining tensor needs (a tied LM head, unused buffers).
        while first < len(sinks) and sinks[first].entry.end <= pos:
            first += 1
        if first < len(sinks) and sinks[first].entry.begin > pos:
            pos = sinks[first].entry.begin
        n = min(chunk, end_all - pos)
        buffer = buffers[which]
        if events[which] is not None:
            events[which].synchronize()         # the copies out of this buffer are done
        _read_exact(f, pos, _bytes(buffer)[:n], path)
        for sink in sinks[first:]:
            if sink.entry.begin >= pos + n:
                break
            lo, hi = max(sink.entry.begin, pos), min(sink.entry.end, pos + n)
            if lo < hi:
                sink.take(buffer, pos, lo, hi)
        if cuda:
            events[which] = torch.cuda.Event()
            events[which].record()
        pos, which = pos + n, 1 - which
    if cuda:
        torch.cuda.current_stream().synchronize()


def read_into(path: Path, targets: list[tuple[Entry, torch.Tensor]], device: torch.device,
              chunk: int = CHUNK, stream: bool | None = None) -> None:
    """Fill each (entry, destination) of one shard; entries in file order, destinations of their
    shape, all on `device`. stream: chunked reads (default on CUDA; tests force them on the CPU)."""
    if not targets:
        return
    cuda = device.type == "cuda"
    with open_regular(path, buffering=0) as f:
        if cuda or stream:
            if cuda:
                with torch.cuda.device(device):
                    _stream(f, path, targets, chunk, cuda=True)
            else:
                _stream(f, path, targets, chunk, cuda=False)
        else:
            _read_to_host(f, path, targets)


__all__ = ["Entry", "read_header", "read_into", "DTYPES", "CHUNK"]
