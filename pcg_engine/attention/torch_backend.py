"""The torch reference backend: plain PyTorch, any device, the oracle for the Triton backend.

Its attention loops over requests on the host (reading query_start_loc_cpu / seq_lens_cpu), so it
can never run inside a full CUDA graph; piecewise graphs are fine, since attention runs eagerly
between pieces. Its RoPE + KV write (apply_rope, write_kv) is plain tensor work that reads nothing
from the host: op.py's rope_kv_write on the CPU, run from inside the compiled pieces.
"""

import torch

from pcg_engine.attention.backend import AttentionBackend
from pcg_engine.attention.rope import apply_rope
from pcg_engine.kernels.norm import rms_norm_ref


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hk, D] into kv_cache [2, NB, BS, Hk, D] at slot_mapping [T]; slot -1 -> scratch block 0."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    slots = slot_mapping.long().clamp_min(0)
    flat[0].index_copy_(0, slots, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v.to(kv_cache.dtype))


def paged_attention_reference(q, kv_cache, query_start_loc, seq_lens, block_table, scale, out):
    """q [T, Hq, D] (rotated); out [T, Hq, D]. Causal within each request's chunk, GQA.

    Request r's queries are the last (qe - qs) of its seq_len positions. Host loop: reference only.
    """
    block_size = kv_cache.shape[2]
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out.zero_()
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        qs, qe = qsl[r], qsl[r + 1]
        n = qe - qs
        if seq_len == 0 or n == 0:
            continue
        nblocks = (seq_len + block_size - 1) // block_size
        blocks = block_table[r, :nblocks].long()
        keys = kv_cache[0, blocks].reshape(-1, num_kv_heads, kv_cache.shape[-1])[:seq_len]
        values = kv_cache[1, blocks].reshape(-1, num_kv_heads, kv_cache.shape[-1])[:seq_len]
        keys = keys.float().repeat_interleave(group, dim=1)      # [L, Hq, D]
        values = values.float().repeat_interleave(group, dim=1)
        query = q[qs:qe].float()                                  # [n, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", probs, values).to(out.dtype)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    cuda_graph_safe = False

    def rope_and_write_kv(self, q, k, v, positions, kv_cache, slot_mapping, q_norm=None, k_norm=None,
                          eps: float = 1e-6) -> torch.Tensor:
        # Plain tensor ops reading nothing from the host, so this half is capturable too.
        if q_norm is not None:
            q, k = rms_norm_ref(q, q_norm, eps), rms_norm_ref(k, k_norm, eps)
        write_kv(apply_rope(k, positions, self.cos_sin), v, kv_cache, slot_mapping)
        return apply_rope(q, positions, self.cos_sin)

    def forward(self, q, out, kv_cache, meta) -> None:
        qsl = meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc.cpu()
        lens = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.cpu()
        paged_attention_reference(q, kv_cache, qsl[: meta.num_reqs + 1], lens[: meta.num_reqs],
                                  meta.block_table, self.scale, out)
