"""torch.compile backend: graph split at attention, per-piece Inductor compile, CUDA-graph capture and
replay per bucket, full decode graphs, and the on-disk compile cache. `setup.py` wires the modes."""
