"""The fused RoPE + KV-write kernel against apply_rope + write_kv (fresh random data every run)."""

import os

import torch

if not torch.cuda.is_available():  # before triton is imported (also done by tests/kernels/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from pcg_engine.attention.rope import apply_rope, rope_cache  # noqa: E402
from pcg_engine.attention.rope_kv import rope_and_write_kv  # noqa: E402
from pcg_engine.attention.torch_backend import write_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(T, Hq, Hk, D, dtype, block_size, num_blocks, num_pad, fused):
    max_pos = 64
    cos_sin = rope_cache(D, max_pos, 10000.0, device=DEVICE)
    if fused:  # q, k, v as strided column slices of one fused qkv output, as the model gives them
        qkv = torch.randn(T, (Hq + 2 * Hk) * D, device=DEVICE, dtype=dtype)
        q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
        q, k, v = q.view(T, Hq, D), k.view(T, Hk, D), v.view(T, Hk, D)
    else:
        q = torch.randn(T, Hq, D, device=DEVICE, dtype=dtype)
        k = torch.randn(T, Hk, D, device=DEVICE, dtype=dtype)
        v = torch.randn(T, Hk, D, device=DEVICE, dtype=dtype)
    positions = torch.randint(0, max_pos, (T,), device=DEVICE)
    # distinct real slots outside the scratch block 0; the last num_pad tokens are padding (-1)
    slots = torch.randperm((num_blocks - 1) * block_size, device=DEVICE)[:T] + block_size
    slots[T - num_pad:] = -1
    cache = torch.randn(2, num_blocks, block_size, Hk, D, device=DEVICE).to(dtype)
    return q, k, v, positions, cos_sin, slots, cache


@pytest.mark.parametrize("T,Hq,Hk,D,dtype,block_size,num_pad,fused", [
    (7, 4, 2, 32, torch.float32, 4, 2, True),
    (5, 2, 2, 64, torch.bfloat16, 16, 1, False),
    (1, 3, 1, 32, torch.float16, 16, 0, True),   # a single token, heads not a power of two
    (4, 4, 1, 16, torch.float32, 4, 4, False),   # all padding
])
def test_rope_kv_matches_reference(T, Hq, Hk, D, dtype, block_size, num_pad, fused):
    q, k, v, positions, cos_sin, slots, cache = _case(T, Hq, Hk, D, dtype, block_size, 6, num_pad, fused)
    ref_cache = cache.clone()
    ref_q = apply_rope(q, positions, cos_sin)
    write_kv(apply_rope(k, positions, cos_sin), v, ref_cache, slots)

    q_out = torch.full_like(q, float("nan"))
    got = rope_and_write_kv(q, k, v, positions, cos_sin, cache, slots, q_out=q_out)
    assert got is q_out
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, ref_q, **tol)
    # Real blocks must match exactly what the reference wrote, and nothing else may change.
    torch.testing.assert_close(cache[:, 1:], ref_cache[:, 1:], **tol)
    # Padding writes land in scratch block 0 at offset 0 (which padding token wins is unordered).
    torch.testing.assert_close(cache[:, 0, 1:], ref_cache[:, 0, 1:], atol=0, rtol=0)
    if num_pad:
        pad_k = apply_rope(k, positions, cos_sin)[T - num_pad:].to(dtype)
        # The same tolerance as the real blocks above: an absolute 2e-2 alone failed now and then in
        # bf16, where one rounding step of a value near 4 is 0.03 (the reference rotates in bf16).
        hit = [torch.allclose(cache[0, 0, 0].float(), pk.float(), **tol) for pk in pad_k]
        assert any(hit)


def test_rope_kv_in_place_and_new_tensor():
    q, k, v, positions, cos_sin, slots, cache = _case(6, 4, 2, 32, torch.float32, 4, 8, 0, False)
    ref_q = apply_rope(q, positions, cos_sin)
    fresh = rope_and_write_kv(q, k, v, positions, cos_sin, cache, slots)  # new tensor
    torch.testing.assert_close(fresh, ref_q, atol=1e-5, rtol=1e-5)
    q_in = q.clone()
    rope_and_write_kv(q_in, k, v, positions, cos_sin, cache, slots, q_out=q_in)  # in place
    torch.testing.assert_close(q_in, ref_q, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T,Hq,Hk,D,dtype,num_pad,fused", [
    (7, 4, 2, 32, torch.float32, 2, True),
    (5, 2, 2, 64, torch.bfloat16, 1, True),
    (3, 3, 1, 32, torch.float16, 0, False),
])
def test_rope_kv_with_head_norm_matches_norm_then_reference(T, Hq, Hk, D, dtype, num_pad, fused):
    from pcg_engine.kernels.norm import rms_norm_ref
    q, k, v, positions, cos_sin, slots, cache = _case(T, Hq, Hk, D, dtype, 4, 8, num_pad, fused)
    q_norm = (torch.rand(D, device=DEVICE) + 0.5).to(dtype)
    k_norm = (torch.rand(D, device=DEVICE) + 0.5).to(dtype)
    ref_cache = cache.clone()
    qn, kn = rms_norm_ref(q, q_norm, 1e-6), rms_norm_ref(k, k_norm, 1e-6)
    ref_q = apply_rope(qn, positions, cos_sin)
    write_kv(apply_rope(kn, positions, cos_sin), v, ref_cache, slots)

    got = rope_and_write_kv(q, k, v, positions, cos_sin, cache, slots, q_norm=q_norm, k_norm=k_norm, eps=1e-6)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, ref_q, **tol)
    torch.testing.assert_close(cache[:, 1:], ref_cache[:, 1:], **tol)
    # The norm really ran: without it the rotated q differs.
    assert not torch.allclose(got.float(), apply_rope(q, positions, cos_sin).float(), atol=1e-3)
    with pytest.raises(ValueError, match="both"):
        rope_and_write_kv(q, k, v, positions, cos_sin, cache, slots, q_norm=q_norm)


@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_head_norm_reads_eps_and_keeps_a_zero_head_zero(eps):
    """Found by a test audit: randn heads have a mean square near 1, where eps = 1e-6 moves nothing a
    tolerance sees, so a head norm that dropped eps passed. Here q and k are scaled to a mean square
    of about eps, and token 0's q and k are zero (0/0 without eps). The padding rows carry positions
    outside the RoPE table, which the kernel clamps (no test fed one before)."""
    from pcg_engine.kernels.norm import rms_norm_ref
    q, k, v, positions, cos_sin, slots, cache = _case(5, 4, 2, 32, torch.float32, 4, 8, 2, True)
    q.mul_(eps ** 0.5), k.mul_(eps ** 0.5)
    q[0], k[0] = 0.0, 0.0
    positions[3], positions[4] = -3, 10**9
    q_norm, k_norm = torch.rand(32, device=DEVICE) + 0.5, torch.rand(32, device=DEVICE) + 0.5
    ref_cache = cache.clone()
    clamped = positions.clamp(0, cos_sin.shape[0] - 1)
    ref_q = apply_rope(rms_norm_ref(q, q_norm, eps), clamped, cos_sin)
    write_kv(apply_rope(rms_norm_ref(k, k_norm, eps), clamped, cos_sin), v, ref_cache, slots)
    got = rope_and_write_kv(q, k, v, positions, cos_sin, cache, slots, q_norm=q_norm, k_norm=k_norm, eps=eps)
    torch.testing.assert_close(got, ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache[:, 1:], ref_cache[:, 1:], atol=1e-5, rtol=1e-5)
    assert (got[0] == 0).all()


def test_mismatched_arguments_are_refused_by_name():
    """The kernel takes T and head_dim from q and trusts every other argument to match: a narrower
    k or v, a shorter positions / slot_mapping, a cos_sin of another head_dim or a norm weight of
    another length was read out of bounds (garbage in the cache or q, no error)."""
    q, k, v, positions, cos_sin, slots, cache = _case(4, 4, 2, 32, torch.float32, 4, 6, 1, False)
    w = torch.ones(32, device=DEVICE)
    base = dict(q=q, k=k, v=v, positions=positions, cos_sin=cos_sin, kv_cache=cache, slot_mapping=slots)
    bad = {
        "k": dict(k=k[..., :16]),
        "v": dict(v=v[..., :16]),
        "positions": dict(positions=positions[:2]),
        "slot_mapping": dict(slot_mapping=slots.float()),
        "cos_sin": dict(cos_sin=rope_cache(16, 64, 10000.0, device=DEVICE)),
        "q_out": dict(q_out=torch.empty(4, 4, 64, device=DEVICE)),
        "q_norm": dict(q_norm=torch.ones(16, device=DEVICE), k_norm=w),
        "k_norm": dict(q_norm=w, k_norm=torch.ones(64, device=DEVICE)[::2]),
    }
    for name, change in bad.items():
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            rope_and_write_kv(**{**base, **change})


def test_q_out_with_a_strided_last_dim_is_refused():
    """q_out was checked for q's shape only; the kernel writes its last dim at unit stride, so a
    permuted view of the right shape was filled in the wrong places without an error."""
    q, k, v, positions, cos_sin, slots, cache = _case(3, 2, 1, 16, torch.float32, 4, 6, 0, False)
    q_out = torch.full((16, 2, 3), float("nan"), device=DEVICE).permute(2, 1, 0)
    assert q_out.shape == q.shape and q_out.stride(2) != 1
    with pytest.raises(ValueError, match="^q_out: expected"):
        rope_and_write_kv(q, k, v, positions, cos_sin, cache, slots, q_out=q_out)
    row_strided = torch.full((3, 2, 24), float("nan"), device=DEVICE)[..., 4:20]   # last dim contiguous: fine
    got = rope_and_write_kv(q, k, v, positions, cos_sin, cache.clone(), slots, q_out=row_strided)
    torch.testing.assert_close(got, apply_rope(q, positions, cos_sin), atol=1e-5, rtol=1e-5)


def test_a_cache_without_two_planes_or_of_other_heads_is_refused():
    """v is written at k's address + kv_cache.stride(0): a one-plane cache [1, NB, BS, Hk, D] had v
    written past its end without an error; another head count failed a bare assert. (The one-plane
    cache is a view of a two-plane buffer here, so the unfixed launch overruns nothing.)"""
    q, k, v, positions, cos_sin, slots, cache = _case(3, 2, 1, 16, torch.float32, 4, 6, 0, False)
    bad = {"one plane": cache[:1], "two kv heads": torch.zeros(2, 6, 4, 2, 16, device=DEVICE)}
    for name, c in bad.items():
        with pytest.raises(ValueError, match="^kv_cache: expected"):
            rope_and_write_kv(q, k, v, positions, cos_sin, c, slots)
