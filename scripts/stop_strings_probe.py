"""The cost of one request with N stop strings to its batch: three greedy requests, one of them with N
stop strings, wall seconds of generate() (CPU, the tiny model).

    python scripts/stop_strings_probe.py N
"""

import sys
import time

from pcg_engine.bench import common
from pcg_engine.llm import LLM
from pcg_engine.sampling_params import SamplingParams

n = int(sys.argv[1])
llm = LLM(common.resolve_model("tiny-qwen3", 0), device="cpu", max_num_seqs=8)
good = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
bad = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[f"zq{i}" for i in range(n)]) if n else good
llm.generate(["warm up"], good)
t = time.perf_counter()
llm.generate(["Hello there", "Once upon", "A third one"], [good, good, bad])
print(f"stop strings {n}: {time.perf_counter() - t:.2f} s")
