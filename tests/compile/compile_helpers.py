"""Helpers of the compile tests: tiny checkpoints, runners, and a lockstep driver for several runners.

`Lockstep` feeds identical steps (requests, chunks, block tables) to several ModelRunners, so their
KV caches evolve identically and their logits can be compared step by step; every runner's
requests get the token the first runner's logits pick, keeping the histories identical too.
"""


import torch
from tiny_checkpoints import build_tiny  # noqa: F401  (re-exported for conftest)

from pcg_engine.config import EngineConfig
from pcg_engine.engine.model_runner import ModelRunner
from pcg_engine.engine.request import Request

RUNNER_DEFAULTS = dict(device="cpu", num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=64)


def make_runner(path, mode: str, **overrides) -> ModelRunner:
    kwargs = {**RUNNER_DEFAULTS, **overrides}
    config = EngineConfig(model=str(path), mode=mode, **kwargs)
    device = torch.device(config.resolved_device())
    return ModelRunner(config, str(path), device)


class Lockstep:
    def __init__(self, runners, block_size: int = 16, blocks_per_request: int = 8):
        self.runners = list(runners)
        self.block_size = block_size
        self.blocks_per_request = blocks_per_request
        self.requests: dict[str, list[Request]] = {}
        self.blocks: dict[str, list[int]] = {}
        self._next_block = 1          # block 0 is the scratch block

    def add(self, rid: str, prompt: list[int]) -> None:
        blocks = list(range(self._next_block, self._next_block + self.blocks_per_request))
        self._next_block += self.blocks_per_request
        self.blocks[rid] = blocks
        self.requests[rid] = []
        for runner in self.runners:
            request = Request(rid, prompt, None)
            runner.batch.add(request)
            runner.batch.update(request, blocks)
            self.requests[rid].append(request)

    def step(self, schedule: list[tuple[str, int]], advance: bool = True):
        """Run one step on every runner; returns [(logits, inputs)] per runner."""
        results = []
        for i, runner in enumerate(self.runners):
            scheduled = [(self.requests[rid][i], n) for rid, n in schedule]
            results.append(runner.execute(scheduled))
        if advance:
            sampled = results[0][1].sample_rows
            tokens = results[0][0].argmax(dim=-1).tolist()
            picked = {r.request_id: t for r, t in zip(sampled, tokens)}
            for rid, n in schedule:
                for i, runner in enumerate(self.runners):
                    request = self.requests[rid][i]
                    request.num_computed_tokens += n
                    if rid in picked:
                        request.append_output(picked[rid])
                    runner.batch.update(request, self.blocks[rid])
        return results

    def close(self) -> None:
        """Release the rows, so the runners can serve another workload."""
        for rid in self.requests:
            for runner in self.runners:
                runner.batch.remove(rid)


# Steps of a mixed workload: prefill chunks and decodes, token counts in and between buckets,
# 1 (bucket 1: unpadded) and, with max_capture_tokens=32, a step above the largest bucket.
PROMPTS = {"a": list(range(3, 8)), "b": [(7 * i) % 1000 + 3 for i in range(17)],
           "c": [(13 * i) % 997 + 5 for i in range(30)], "d": [(11 * i) % 991 + 2 for i in range(9)]}
SCHEDULE = [
    [("a", 5)],                                   # T=5
    [("a", 1)],                                   # T=1
    [("b", 13), ("a", 1)],                        # T=14
    [("b", 4), ("a", 1), ("c", 30)],              # T=35 (above a 32 bucket)
    [("a", 1), ("b", 1), ("c", 1), ("d", 9)],     # T=12
    [("a", 1), ("b", 1), ("c", 1), ("d", 1)],     # T=4
    [("a", 1), ("c", 1)],                         # T=2
    [("a", 1), ("b", 1), ("d", 1)],               # T=3
]


def run_workload(runners, check, schedule=SCHEDULE, prompts=PROMPTS):
    """Drive the workload in lockstep; check(results, step_index) after every step."""
    lock = Lockstep(runners)
    try:
        for rid, prompt in prompts.items():
            lock.add(rid, prompt)
        for index, step in enumerate(schedule):
            check(lock.step(step), index)
    finally:
        lock.close()
    return lock
