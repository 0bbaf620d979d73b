"""Per-step attention metadata: where each request's tokens are and where its KV lives."""

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """What attention needs about one step's flat batch (DESIGN.md, "Flat batch").

    Device tensors (read by kernels, safe inside a CUDA graph):
      query_start_loc [R+1] int32: request r owns flat rows query_start_loc[r]:query_start_loc[r+1].
      seq_lens        [R]   int32: KV length of request r after this step's tokens are written.
                                   0 marks a padding request: attention returns zeros for it.
      block_table     [R, max_blocks] int32: physical KV blocks of request r, in order.
      slot_mapping    [T]   int64: KV slot (block * block_size + offset) of each flat token;
                                   -1 for padding tokens, written to the scratch block.
    Host values (decide kernel grids, so for a graphed step they are the bucket's, not the step's):
      num_reqs, num_tokens (T, including padding), max_query_len, max_seq_len.
    Optional host copies (the torch reference backend loops over requests with them):
      query_start_loc_cpu, seq_lens_cpu.
    Filled by the backend on the step's first attention call, for the other layers to reuse:
      num_splits (Triton split-KV count: a function of host values that are the same for every layer).
    Rows of the output beyond query_start_loc[num_reqs] belong to no request and are zeroed.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    num_splits: int | None = None

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


def check_index_tensor(name: str, t: torch.Tensor, dims: int, rows: int) -> None:
    """A metadata tensor the attention kernels index with the launch's host values (query_start_loc,
    seq_lens, block_table): integer, `dims`-D, at least `rows` rows. A shorter or float one was read
    out of bounds or failed deep inside Triton; the launchers call this before their JIT launch."""
    if t.dtype not in (torch.int32, torch.int64) or t.dim() != dims or t.shape[0] < rows:
        raise ValueError(f"{name}: expected int32/int64, {dims}-D, >= {rows} rows; got {tuple(t.shape)} {t.dtype}")
