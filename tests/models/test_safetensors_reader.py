"""The loader's safetensors reader (models/safetensors_reader.py) against safetensors' own load_file:
every dtype, tensors split across chunk boundaries, skipped regions, converting destinations, and
headers that lie about the file."""

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from pcg_engine.errors import CheckpointError
from pcg_engine.models.safetensors_reader import read_header, read_into


@pytest.fixture
def shard(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.bf16": torch.randn(7, 13, generator=g).to(torch.bfloat16),
        "b.f32": torch.randn(3, 5, 2, generator=g),
        "c.f16": torch.randn(33, generator=g).to(torch.float16),
        "d.i64": torch.randint(-9, 9, (4, 3), generator=g),
        "e.bool": torch.rand(5, generator=g) > 0.5,
        "f.u8": torch.randint(0, 255, (17,), generator=g).to(torch.uint8),
        "g.empty": torch.zeros(0, 4),
        "h.big": torch.randn(300, generator=g).to(torch.bfloat16),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def fill(path, names=None, dtypes=None, **kwargs):
    entries = [e for e in read_header(path) if names is None or e.name in names]
    dests = [torch.full(e.shape, 7, dtype=(dtypes or {}).get(e.name, e.dtype)) for e in entries]
    read_into(path, list(zip(entries, dests)), torch.device("cpu"), **kwargs)
    return {e.name: d for e, d in zip(entries, dests)}


@pytest.mark.parametrize("mode", [{}, {"stream": True, "chunk": 7}, {"stream": True, "chunk": 64},
                                  {"stream": True, "chunk": 1 << 20}])
def test_matches_load_file(shard, mode):
    want = load_file(str(shard))
    got = fill(shard, **mode)
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


@pytest.mark.parametrize("mode", [{}, {"stream": True, "chunk": 5}])
def test_subset_and_converting_destinations(shard, mode):
    want = load_file(str(shard))
    names = {"b.f32", "f.u8", "h.big"}              # the rest of the file is skipped
    got = fill(shard, names, {"h.big": torch.float32, "f.u8": torch.int64}, **mode)
    assert set(got) == names
    assert torch.equal(got["b.f32"], want["b.f32"])
    assert got["h.big"].dtype == torch.float32 and torch.equal(got["h.big"], want["h.big"].float())
    assert torch.equal(got["f.u8"], want["f.u8"].long())


def test_strided_view_destination(shard):
    """A slice of a larger parameter, as the loader fills MoE experts (contiguous rows)."""
    entry = next(e for e in read_header(shard) if e.name == "a.bf16")
    big = torch.zeros(3, 14, 13, dtype=torch.bfloat16)
    read_into(shard, [(entry, big[1][7:14])], torch.device("cpu"), stream=True, chunk=11)
    assert torch.equal(big[1][7:14], load_file(str(shard))["a.bf16"]) and big[0].abs().sum() == 0


def write_raw(path, header: dict, data: bytes):
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


@pytest.mark.parametrize("header, data, message", [
    ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "beyond the file"),
    ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16, "do not hold F32"),
    # a dtype this reader does not load is said to be one, not a damaged entry
    ({"x": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 2]}}, b"\0" * 2,
     "has dtype 'Q4', which this engine does not load; allowed: BOOL, U8"),
    ({"x": {"dtype": "F32", "shape": "4", "data_offsets": [0, 4]}}, b"\0" * 4, "invalid header entry"),
    ({"x": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, "invalid header entry"),
])
def test_bad_headers_are_named(tmp_path, header, data, message):
    path = tmp_path / "bad.safetensors"
    write_raw(path, header, data)
    with pytest.raises(CheckpointError, match=message) as info:
        read_header(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("header, message", [
    # Found by probing: a shape of more than one character that is not a list raised a bare
    # TypeError out of math.prod ("can't multiply sequence by non-int of type 'str'").
    ({"x": {"dtype": "F32", "shape": "16", "data_offsets": [0, 64]}}, "tensor 'x' has an invalid header entry"),
    ({"x": {"dtype": "F32", "shape": {"a": 1}, "data_offsets": [0, 4]}}, "tensor 'x' has an invalid header entry"),
    # true is an int to Python: a shape [16, true] loaded as [16, 1], offsets [false, ...] as 0.
    ({"x": {"dtype": "F32", "shape": [16, True], "data_offsets": [0, 64]}}, "tensor 'x': data_offsets [0, 64] do not hold F32 [16, True]"),
    ({"x": {"dtype": "F32", "shape": ["a", "b"], "data_offsets": [0, 4]}}, "tensor 'x': data_offsets [0, 4] do not hold F32 ['a', 'b']"),
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [False, 4]}}, "tensor 'x': data_offsets [False, 4] do not hold F32 [1]"),
])
def test_header_entries_of_the_wrong_form_are_named(tmp_path, header, message):
    path = tmp_path / "bad.safetensors"
    write_raw(path, header, b"\0" * 64)
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    assert str(info.value).startswith(f"{path}: {message}"), str(info.value)


def test_overlapping_tensors_are_refused(tmp_path):
    """Found by probing: a header whose tensors share bytes (one's data_offsets inside another's)
    loaded both from them, one tensor's values in the other's place, without a word; safetensors
    itself refuses such a file."""
    path = tmp_path / "overlap.safetensors"
    write_raw(path, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                     "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
                     "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}}, b"\0" * 24)
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    assert str(info.value) == (f"{path}: tensors 'a' (data bytes 0..16) and 'b' (data bytes 8..24) overlap; "
                               "each tensor has bytes of its own")
    # Adjacent, with an empty tensor between: taken.
    write_raw(path, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                     "e": {"dtype": "F32", "shape": [0], "data_offsets": [16, 16]},
                     "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}}, b"\0" * 24)
    assert [e.name for e in read_header(path)] == ["a", "e", "b"]


@pytest.mark.parametrize("header, size, message", [
    pytest.param({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                  "b": {"dtype": "F32", "shape": [1], "data_offsets": [20, 24]}}, 24,
                 "data bytes 16..20 belong to no tensor (before 'b')", id="hole"),
    pytest.param({"b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, 8,
                 "data bytes 0..4 belong to no tensor (before 'b')", id="hole-first"),
    pytest.param({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 24,
                 "8 bytes after the last tensor's data", id="trailing"),
])
def test_bytes_no_tensor_holds_are_refused(tmp_path, header, size, message):
    """Found by a review: a file with a hole between tensors or bytes after the last loaded, where
    safetensors (and so transformers) refuses it; the bytes may be a tensor its header lost."""
    path = tmp_path / "holes.safetensors"
    write_raw(path, header, b"\0" * size)
    with pytest.raises(CheckpointError, match=r"safetensors file") as info:
        read_header(path)
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value), str(info.value)
    with pytest.raises(Exception):     # the reference refuses it too
        load_file(str(path))


@pytest.mark.parametrize("reader", ["header", "into"])
def test_a_named_pipe_is_refused_not_waited_on(tmp_path, shard, reader):
    """Found by a review: a named pipe as a shard blocked the load in open() for good (until
    something wrote to it). Run in a thread so a regression fails instead of hanging the suite."""
    import os

    from named_pipes import error_of
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    entries = read_header(shard)
    dest = torch.empty(entries[0].shape, dtype=entries[0].dtype)
    error = error_of(lambda: read_header(fifo) if reader == "header" else
                     read_into(fifo, [(entries[0], dest)], torch.device("cpu")), tmp_path, timeout=20)
    assert isinstance(error, CheckpointError), error
    assert str(error) == f"{fifo}: is a named pipe; a checkpoint's files are regular files"


@pytest.mark.parametrize("blob, message", [
    pytest.param(b'{"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                 b'"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}',
                 "the safetensors header names tensor 'x' more than once", id="tensor-twice"),
    pytest.param(b'{"x": {"dtype": "F32", "shape": [1], "shape": [2], "data_offsets": [0, 8]}}',
                 "tensor 'x': its header entry gives 'shape' more than once", id="field-twice"),
])
def test_repeated_header_keys_are_refused(tmp_path, blob, message):
    """Found by probing: json keeps the last of a repeated key, so a shard naming a tensor twice
    loaded one of the two without a word."""
    path = tmp_path / "twice.safetensors"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * 8)
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    assert str(info.value).startswith(f"{path}: {message}")


@pytest.mark.parametrize("value, expected", [
    (b"[" * 100_000 + b"]" * 100_000, "invalid safetensors header (nested deeper than Python's json reader goes)"),
    (b"9" * 5000, "invalid safetensors header (Exceeds the limit (4300 digits) for integer string conversion"),
])
def test_header_beyond_the_json_readers_limits_is_named(tmp_path, value, expected):
    """Found by probing: a header nested 100,000 deep or holding a 5000-digit number raised a bare
    RecursionError or ValueError out of json.loads, naming no file."""
    path = tmp_path / "deep.safetensors"
    blob = b'{"__metadata__": {"format": "pt"}, "x": ' + value + b"}"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    assert str(info.value).startswith(f"{path}: {expected}"), str(info.value)


def test_not_safetensors(tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="header length") as info:
        read_header(path)
    assert str(info.value).startswith(f"{path}: not a safetensors file (header length")
    path.write_bytes(b"\x01")
    with pytest.raises(CheckpointError, match="shorter than"):
        read_header(path)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [64, 1 << 26])
def test_streams_to_the_gpu(shard, chunk):
    """The pinned double-buffered path: chunks reused while earlier copies may still be in flight."""
    want = load_file(str(shard))
    entries = read_header(shard)
    dests = [torch.full(e.shape, 7, dtype=torch.float32 if e.name == "h.big" else e.dtype, device="cuda")
             for e in entries]
    read_into(shard, list(zip(entries, dests)), torch.device("cuda"), chunk=chunk)
    for e, d in zip(entries, dests):
        assert torch.equal(d.cpu(), want[e.name].to(d.dtype)), e.name
