"""RMSNorm and fused residual-add + RMSNorm: one memory pass per row block.

Unfused, a decoder layer's `residual = x + residual; h = norm(residual)` reads and writes the
hidden state three times; here the add, the reduction and the scale share one read of x and the
residual and one write of each output.

Rounding follows Hugging Face's Qwen3RMSNorm exactly, so fused and unfused paths agree to the bit
wherever the hardware's rsqrt does:
  * the residual sum is rounded to the storage dtype before it is normalised (transformers adds
    in bf16, then normalises that rounded value, and the next layer reads the rounded residual);
  * the variance and scaling are fp32;
  * the normalised value is rounded to the input dtype *before* the weight multiply
    (`weight * hidden.to(input_dtype)`), and the product is rounded again.

Both functions take x [..., D] (the last dim must be unit-stride, rows may be strided; anything
else is copied), so per-head q/k norm is `rms_norm(q.view(T * H, head_dim), w, eps)`. Outputs are
new contiguous tensors in x.dtype.
"""

import torch
import triton
import triton.language as tl

from pcg_engine.kernels import pdl
from pcg_engine.kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_rows, D,
                     stride_x, stride_r, stride_o, stride_ro, eps, stride_xs,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                     NUM_PARTIALS: tl.constexpr, PDL: tl.constexpr):
    # NUM_PARTIALS >= 1: x is a projection's split-K partials [S, rows, D] in fp32 (kernels/split_k.py,
    # S slices stride_xs apart); their sum, rounded to the activation dtype as the projection's
    # output would be, is the x added to the residual. 0: x is the activation itself.
    if PDL:  # kernels/pdl.py: x and the residual come from the kernels before
        gdc_wait()
        gdc_launch_dependents()
    # A [BLOCK_R, BLOCK_D] tile: one row per program for wide D, several for head_dim-sized D,
    # so a small D still gives each program enough bytes in flight.
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if NUM_PARTIALS > 0:
        for s in tl.static_range(1, NUM_PARTIALS):
            x += tl.load(x_ptr + s * stride_xs + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        # Also for S = 1: one fp32 partial is still unrounded (the rounding once sat under
        # `NUM_PARTIALS > 1`, so S = 1 added the fp32 product to the residual unrounded).
        x = x.to(out_ptr.dtype.element_ty).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows[:, None] * stride_ro + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    y = (x * rstd[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :],
             (w[None, :] * y).to(out_ptr.dtype.element_ty), mask=mask)


def _launch_config(n_rows: int, d: int, partials: bool = False) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps): about 4K elements a program, 16 per thread (two 16-byte
    bf16 vectors per load), but never so many rows a program that a small batch runs on a
    handful of SMs. With split-K partials each program reads S fp32 rows per output row (4 x 16 KB
    at Qwen3-8B's 4096): twice the warps keep twice the loads in flight. Qwen3-8B's o and down +
    this norm at one row, 4 splits (scripts/bench_split_k_norm.py, H200, session 19): 14.17 -> 13.34
    and 30.00 -> 29.27 us with 16 warps instead of 8."""
    block_d = triton.next_power_of_2(d)
    block_r = max(1, min(64, 4096 // block_d, triton.next_power_of_2(triton.cdiv(n_rows, 512))))
    num_warps = max(1, min(16, block_r * block_d // 512))
    return block_r, block_d, min(16, 2 * num_warps) if partials else num_warps


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    t2 = t.reshape(-1, d)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> int:
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x: expected shape [..., D] with D > 0, got {tuple(x.shape)}")
    d = x.shape[-1]
    # Integer tensors went through the kernel's fp32 math and came back truncated (all zeros).
    if not x.is_floating_point() or not weight.is_floating_point():
        raise ValueError(f"x, weight: expected floating-point dtypes, got {x.dtype}, {weight.dtype}")
    if weight.shape != (d,):
        raise ValueError(f"weight: expected shape ({d},) to match x's last dim, got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight: on {weight.device}, x on {x.device}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"residual: expected {tuple(x.shape)} {x.dtype} on {x.device}, "
                             f"got {tuple(residual.shape)} {residual.dtype} on {residual.device}")
    return d


def _launch(x, residual, weight, eps, partials=None):
    """partials: a projection's split-K partials [S, rows, D] (fp32) standing in for x, which then
    only gives the shape and dtype of the outputs (residual)."""
    d = _check(x, weight, residual)
    x2 = _rows(x, d) if partials is None else partials
    n = x2.shape[-2]
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if residual is None:
        r2 = res_out = x2  # unused: HAS_RESIDUAL=False compiles the loads and stores away
    else:
        r2 = _rows(residual, d)
        res_out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if n > 0:
        block_r, block_d, num_warps = _launch_config(n, d, partials is not None)
        _rms_norm_kernel[(triton.cdiv(n, block_r),)](
            x2, r2, weight.contiguous(), out, res_out, n, d,
            x2.stride(-2), r2.stride(0), out.stride(0), res_out.stride(0), float(eps),
            x2.stride(0) if partials is not None else 0,
            HAS_RESIDUAL=residual is not None, BLOCK_R=block_r, BLOCK_D=block_d,
            NUM_PARTIALS=0 if partials is None else partials.shape[0], num_warps=num_warps,
            **pdl.launch_kwargs(x.device))
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rmsnorm(x) * weight over the last dim, fp32 math, result in x.dtype."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual) in one pass; both in x.dtype."""
    return _launch(x, residual, weight, eps)


def add_rms_norm_partials(partials: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm(x, residual, ...) where x = partials.sum(0) rounded to residual's dtype:
    partials [S, rows, D] fp32 from kernels/split_k.py, residual [rows, D]; one pass, one launch."""
    # S >= 1: the kernel always reads partial 0 (S = 0 read past an empty tensor: a segfault on the CPU).
    if partials.dim() != 3 or partials.shape[0] < 1 or partials.dtype != torch.float32 \
            or partials.shape[1:] != residual.shape or partials.stride(-1) != 1 or partials.device != residual.device:
        raise ValueError(f"partials: expected [S >= 1, {', '.join(map(str, residual.shape))}] float32 on "
                         f"{residual.device}, last dim contiguous; got {tuple(partials.shape)} {partials.dtype} "
                         f"on {partials.device}")
    return _launch(residual, residual, weight, eps, partials=partials)


def add_rms_norm_partials_ref(partials: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    return add_rms_norm_ref(partials.sum(0).to(residual.dtype), residual, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' Qwen3RMSNorm.forward, cast to x.dtype (a no-op when weight has x's dtype)."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(input_dtype)).to(input_dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual
