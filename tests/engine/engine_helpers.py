"""Helpers of the engine tests (imported by conftest.py and the test modules).

Engines built here get an invariant hook: after every step the block manager is checked, no
published block holds a placeholder, every published block a live request holds records that
request's tokens, and no output carries a placeholder.
"""

import json
import os
from pathlib import Path

import torch
from tiny_checkpoints import build_tiny  # noqa: F401  (re-exported for conftest)
from pcg_engine.engine.request import RequestStatus


def make_eos_checkpoint(src: Path, out: Path, eos: int) -> Path:
    """A copy of checkpoint `src` in `out` (files symlinked) whose generation_config.json lists `eos`
    first among the EOS ids."""
    for f in Path(src).iterdir():
        if f.name != "generation_config.json":
            os.symlink(f, out / f.name)
    gen = json.loads((Path(src) / "generation_config.json").read_text())
    old = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    gen["eos_token_id"] = [eos] + [e for e in old if e != eos]
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


# ---- transformers reference -------------------------------------------------------------------

class HFReference:
    """transformers' own model on a checkpoint: greedy continuations (cached) and logprobs."""

    def __init__(self, path: Path):
        from transformers import AutoModelForCausalLM

        self.path = path
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = {eos} if isinstance(eos, int) else set(eos)
        self._cache: dict = {}

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_tokens: int, stop_at_eos: bool = True) -> list[int]:
        """Greedy continuation of one prompt (one sequence at a time: no padding), up to and
        including the first EOS when stop_at_eos."""
        key = (tuple(prompt_ids), max_tokens)
        if key not in self._cache:
            ids = torch.tensor([list(prompt_ids)])
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)
            tokens = out[0, ids.shape[1]:].tolist()
            assert len(tokens) == max_tokens, "transformers stopped early: EOS override ignored"
            self._cache[key] = tokens
        tokens = self._cache[key]
        if stop_at_eos:
            for i, t in enumerate(tokens):
                if t in self.eos:
                    return tokens[:i + 1]
        return list(tokens)

    @torch.inference_mode()
    def logprobs(self, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
        """[len(tokens), V] log-softmax of the logits that predicted each of `tokens`."""
        ids = torch.tensor([list(prompt_ids) + list(tokens)])
        logits = self.model(ids).logits[0, len(prompt_ids) - 1:-1]
        return torch.log_softmax(logits.float(), dim=-1)


# ---- engines ----------------------------------------------------------------------------------

def make_llm(path, **config):
    from pcg_engine.llm import LLM

    config.setdefault("device", "cpu")
    config.setdefault("max_num_seqs", 16)
    config.setdefault("max_model_len", 256)
    llm = LLM(str(path), **config)
    install_invariant_hook(llm.engine)
    return llm


def check_engine_state(engine) -> None:
    bm = engine.block_manager
    bm.check_invariants()
    for block in bm.blocks:
        if block.hash is not None:
            assert all(t >= 0 for t in block.tokens), f"block {block.block_id} cached with a placeholder"
    bs = bm.block_size
    for rid, table in bm._tables.items():
        request = engine.scheduler.requests.get(rid)
        assert request is not None and not request.is_finished, f"blocks held by finished/unknown {rid!r}"
        for i, block_id in enumerate(table):
            block = bm.blocks[block_id]
            if block.hash is not None:
                assert list(block.tokens) == request.token_ids[i * bs:(i + 1) * bs], (
                    f"{rid}: block {block_id} is cached under tokens the request doesn't hold")
    # An input-batch row belongs to a running request, and the block ids written into it are the
    # block manager's: a stale row (kept across a preemption) would read and write other blocks.
    batch = engine.runner.batch
    for rid, row in getattr(batch, "row_of", {}).items():
        request = engine.scheduler.requests.get(rid)
        assert request is not None and request.status is RequestStatus.RUNNING, (
            f"{rid} holds input-batch row {row} while {None if request is None else request.status}")
        if not hasattr(batch, "num_blocks"):     # the P4 benchmark's per-step rebuild keeps no tables
            continue
        n = int(batch.num_blocks[row])
        assert batch.block_table[row, :n].tolist() == bm.block_table(rid)[:n], (
            f"{rid}: row {row}'s block table {batch.block_table[row, :n].tolist()} is not the block "
            f"manager's {bm.block_table(rid)[:n]}")


def install_invariant_hook(engine) -> None:
    """Wrap engine.step: after each step check the engine's state and the outputs' tokens. Wrap the
    block manager's hash function: a placeholder must never be hashed (published or looked up)."""
    real_step = engine.step
    bm = engine.block_manager
    real_hash = bm.hash_fn

    def hash_fn(parent, tokens):
        assert all(t >= 0 for t in tokens), f"a placeholder reached the prefix-cache hash: {list(tokens)}"
        return real_hash(parent, tokens)

    bm.hash_fn = hash_fn

    def step():
        outputs = real_step()
        for out in outputs:
            assert all(t >= 0 for t in out.token_ids), f"placeholder in the output of {out.request_id}"
            assert all(t >= 0 for t in out.new_token_ids), f"placeholder in the delta of {out.request_id}"
            n = len(out.new_token_ids)
            assert n == 0 or out.token_ids[-n:] == out.new_token_ids, "delta is not the output's tail"
        check_engine_state(engine)
        return outputs

    engine.step = step


def assert_drained(engine) -> None:
    """No request, no in-flight step, no input-batch row and no KV block left behind."""
    assert not engine.has_unfinished_requests()
    assert not engine.requests and not engine.scheduler.requests
    assert engine.inflight is None
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks, (
        f"{bm.num_total_blocks - bm.num_free_blocks} KV blocks leaked")
    assert not bm._tables
    assert not engine.runner.batch.row_of, "input-batch rows leaked"
    assert all(p is None for p in engine.sampling.params), "sampling rows leaked"
    bm.check_invariants()


def drain(engine, max_steps: int = 2_000) -> dict:
    """Step until nothing is left; returns the final output of every request that finished."""
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals, f"{out.request_id} finished twice"
                finals[out.request_id] = out
    s = engine.scheduler
    assert not engine.has_unfinished_requests(), (
        f"engine did not drain in {max_steps} steps: running {s.running}, waiting {list(s.waiting)[:4]}, "
        f"free blocks {engine.block_manager.num_free_blocks}")
    return finals


def run_requests(engine, requests, steps_before: int = 0) -> dict:
    """Add [(request_id, prompt, params)] and drain; outputs by id."""
    for rid, prompt, params in requests:
        engine.add_request(prompt, params, request_id=rid)
    return drain(engine)


def random_prompts(lengths, seed: int = 0, vocab: int = 1024, low: int = 3) -> list[list[int]]:
    """Random token prompts (ids >= low: no special token) of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=g).tolist() for n in lengths]


def first_diff(a, b) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def assert_tokens(got: list[list[int]], want: list[list[int]], what: str = "") -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"{what} request {i}: differs at output {first_diff(g, w)}:\n  got  {g}\n  want {w}"
