"""SiLU-and-mul: the SwiGLU activation of a fused gate_up projection, in one memory pass.

x [..., 2I] holds gate in [..., :I] and up in [..., I:]; out[..., j] = silu(gate[j]) * up[j].
Unfused, torch reads x twice through two slices and writes the silu result in between.
Math is fp32 with one rounding at the end (transformers rounds silu(gate) to the storage dtype
first, so bf16 results may differ from it by one ulp). The last dim must be unit-stride (rows
may be strided, e.g. a slice of a larger buffer); anything else is copied.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pcg_engine.kernels import pdl
from pcg_engine.kernels.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_rows, width, stride_x, stride_o,
                         BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # kernels/pdl.py: the input comes from the kernel before
        gdc_wait()
        gdc_launch_dependents()
    # A [BLOCK_R, BLOCK] tile: row blocks on grid axis 0 (which allows 2^31 programs), column
    # blocks on axis 1. Several rows a program keep enough bytes in flight when I is small.
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < width)[None, :]
    src = x_ptr + rows[:, None] * stride_x + cols[None, :]
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + width, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _block(width: int) -> int:
    """The largest power of two <= 1024 that divides width (no masked-off lanes: 768 -> 256,
    3072 -> 1024); widths with no such divisor >= 128 fall back to a masked power of two."""
    block = min(1024, width & -width)
    return block if block >= 128 or block == width else min(1024, triton.next_power_of_2(width))


def _launch_config(n_rows: int, width: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK, num_warps): ~4K outputs a program, 16 per thread, but fewer rows a
    program when the batch is small so it still spreads over the SMs."""
    block = _block(width)
    block_r = max(1, min(4096 // block, triton.next_power_of_2(triton.cdiv(n_rows, 512))))
    return block_r, block, max(1, min(8, block_r * block // 512))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:] as a new contiguous [..., I] in x.dtype."""
    if x.dim() < 1 or x.shape[-1] % 2 or x.shape[-1] == 0:
        raise ValueError(f"x: expected shape [..., 2I] with an even, nonzero last dim, got {tuple(x.shape)}")
    if not x.is_floating_point():  # an integer x came back as truncated fp32 math (zeros)
        raise ValueError(f"x: expected a floating-point dtype, got {x.dtype}")
    width = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = x2.shape[0]
    out = torch.empty((n, width), dtype=x.dtype, device=x.device)
    if n > 0:
        block_r, block, num_warps = _launch_config(n, width)
        _silu_and_mul_kernel[(triton.cdiv(n, block_r), triton.cdiv(width, block))](
            x2, out, n, width, x2.stride(0), out.stride(0), BLOCK_R=block_r, BLOCK=block, num_warps=num_warps,
            **pdl.launch_kwargs(x.device))
    return out.view(*x.shape[:-1], width)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """What transformers' Qwen3MLP does: act_fn(gate) * up, in the input dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
