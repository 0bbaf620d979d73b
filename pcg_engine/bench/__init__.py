"""User-facing benchmarks, run as `pcg bench NAME ...` or `python scripts/<name>.py ...`.

    latency      P1  batch-1 TTFT and TPOT
    throughput   P2  offline output tokens per second
    load_test    P3  TTFT / TPOT / ITL / E2EL under Poisson or gamma arrivals, goodput, rate sweep
    overhead     the chapter's overhead table (eager / fused / async / graphs); --host-only is P4
    profile      torch.profiler over decode steps: kernels per step, device idle gaps, timeline PNG
    kernels      delegates to scripts/bench_kernels.py

Every benchmark prints a rich table and, with --json PATH, writes its numbers together with the
environment (model, commit, torch, triton, device, date) and its full configuration.
"""
