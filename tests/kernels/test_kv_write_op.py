"""pcg::rope_kv_write (attention/op.py) through each backend against the reference it replaced:
apply_rope on q and k, write_kv of rotated k and v, padding rows (slot -1) into the scratch block.
Before the op existed both halves ran inside the attention op; the cache and the rotated q must be
what they were."""

import os

import torch

if not torch.cuda.is_available():  # before triton is imported (also done by tests/kernels/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from pcg_engine.attention.backend import make_backend  # noqa: E402
from pcg_engine.attention.context import ForwardContext, set_forward_context  # noqa: E402
from pcg_engine.attention.metadata import AttentionMetadata  # noqa: E402
from pcg_engine.attention.op import rope_kv_write  # noqa: E402
from pcg_engine.attention.rope import apply_rope, rope_cache  # noqa: E402
from pcg_engine.attention.torch_backend import write_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _meta(slots):
    T = slots.shape[0]
    zero = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    return AttentionMetadata(query_start_loc=zero, seq_lens=zero[:0], block_table=zero[:0].view(0, 1),
                             slot_mapping=slots, num_reqs=0, num_tokens=T, max_query_len=0, max_seq_len=0)


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
@pytest.mark.parametrize("T,num_pad,dtype", [(9, 3, torch.float32), (4, 1, torch.bfloat16), (2, 2, torch.float32)])
def test_rope_kv_write_matches_reference(backend_name, T, num_pad, dtype):
    Hq, Hk, D, BS, NB, max_pos = 4, 2, 32, 4, 8, 64
    cos_sin = rope_cache(D, max_pos, 10000.0, device=DEVICE)
    backend = make_backend(backend_name, num_heads=Hq, num_kv_heads=Hk, head_dim=D, block_size=BS, cos_sin=cos_sin)
    # q, k, v as the model gives them: head-shaped views of one fused qkv output (v strided).
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, device=DEVICE, dtype=dtype)
    q, k, v = (x.view(T, -1, D) for x in qkv.split([Hq * D, Hk * D, Hk * D], dim=-1))
    positions = torch.randint(0, max_pos, (T,), device=DEVICE)
    slots = torch.randperm((NB - 1) * BS, device=DEVICE)[:T] + BS     # real slots outside block 0
    slots[T - num_pad:] = -1                                          # padding rows
    positions[T - num_pad:] = 0
    cache = torch.randn(2, NB, BS, Hk, D, device=DEVICE).to(dtype)
    expected_cache = cache.clone()
    write_kv(apply_rope(k, positions, cos_sin), v, expected_cache, slots)
    q_before = q.clone()

    with set_forward_context(ForwardContext(_meta(slots), [cache], backend)):
        q_rot = rope_kv_write(q, k, v, positions, cache)

    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q_rot, apply_rope(q, positions, cos_sin), **tol)
    assert q_rot.shape == (T, Hq, D) and q_rot.data_ptr() != q.data_ptr()
    assert torch.equal(q, q_before), "the op must not write its q input"
    # Every block but the scratch block as the reference left it (the real rows written, the rest
    # untouched); in the scratch block only slot 0, where the padding rows go, may change.
    torch.testing.assert_close(cache[:, 1:], expected_cache[:, 1:], **tol)
    torch.testing.assert_close(cache[:, 0, 1:], expected_cache[:, 0, 1:], atol=0, rtol=0)


def test_rope_kv_write_without_metadata_writes_nothing():
    """The runner's memory-profiling forward: no metadata, no write, q passed through as a copy."""
    cos_sin = rope_cache(32, 16, 10000.0, device=DEVICE)
    backend = make_backend("torch", num_heads=2, num_kv_heads=1, head_dim=32, block_size=4, cos_sin=cos_sin)
    q, k = torch.randn(3, 2, 32, device=DEVICE), torch.randn(3, 1, 32, device=DEVICE)
    cache = torch.zeros(2, 2, 4, 1, 32, device=DEVICE)
    with set_forward_context(ForwardContext(None, [], backend)):
        out = rope_kv_write(q, k, k, torch.zeros(3, dtype=torch.long, device=DEVICE), cache)
    assert torch.equal(out, q) and out.data_ptr() != q.data_ptr() and not cache.any()


@pytest.mark.parametrize("head_dim", [24, 48, 80, 96])
def test_triton_backend_refuses_a_head_dim_its_kernels_do_not_run(head_dim):
    """Found by the kernel probe: the model config takes any even head_dim, and the Triton backend
    met one that is not a power of two only at the first step, on a bare assert (gone under
    python -O). It is refused when the backend is made, naming the backend that runs it; the CLI
    names the flag (cli.flag_wording)."""
    from pcg_engine.cli import flag_wording
    from pcg_engine.errors import ConfigError
    cos_sin = rope_cache(head_dim, 64, 10000.0, device=DEVICE)
    with pytest.raises(ConfigError) as e:
        make_backend("triton", num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=16, cos_sin=cos_sin)
    assert e.value.field == "attention_backend"
    assert str(e.value) == (f"attention_backend: 'triton' runs head_dim 16, 32, 64, 128, 256; this checkpoint's "
                            f"head_dim is {head_dim}: use attention_backend='torch' (modes eager, compile or piecewise)")
    assert flag_wording(str(e.value)).endswith("use --attention-backend torch (modes eager, compile or piecewise)")
    assert make_backend("torch", num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=16,
                        cos_sin=cos_sin).head_dim == head_dim
