"""EngineConfig: every engine setting in one validated dataclass.

Unknown keyword arguments are refused by name (`EngineConfig.from_kwargs`), so a typo fails loudly
instead of silently running a default.
"""

import dataclasses
import os
import re
import warnings
from dataclasses import dataclass, field

import numpy as np

from pcg_engine.errors import ConfigError

# What kernels=True with fuse=False may be instead (EngineConfig and models/loader.load_model refuse
# it): the fuse transform is what switches the kernels on, so without it they were dropped unsaid.
KERNELS_WITHOUT_FUSE = "None or False with fuse=False (the Triton kernels run on the fused model: fuse=True)"

MODES = ("eager", "compile", "full_decode", "piecewise", "full_and_piecewise")
# The modes that run the forward through torch.compile (Dynamo and Inductor); full_decode captures the
# eager model.
COMPILED_MODES = ("compile", "piecewise", "full_and_piecewise")
# A step's token budget sizes per-token buffers (the runner's step buffers and their pinned copies,
# ~128 bytes a token), the KV sizing's forward on CUDA and the warm-up's pass over every token count.
# 2**18: a whole prompt of the longest context the supported models take (Qwen3-2507's 262,144) in one
# step; chunked prefill splits longer ones, and a larger budget would only fail in an allocation.
MAX_NUM_BATCHED_TOKENS = 2**18
MAX_NUM_SEQS = 4096
# The modes that read each bucket list (compile/setup.py takes them from here): piecewise graphs pad
# a step to a token bucket, full decode graphs a decode batch to a batch bucket; eager and compile
# capture no graphs.
BUCKET_MODES = {"cudagraph_buckets": ("piecewise", "full_and_piecewise"),
                "decode_buckets": ("full_decode", "full_and_piecewise")}
# The modes that capture CUDA graphs on a CUDA device (on the CPU none captures): those reading a bucket list.
CAPTURING_MODES = tuple(m for m in MODES if any(m in modes for modes in BUCKET_MODES.values()))


def default_buckets(max_tokens: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 256, of 16 to 512, then powers of two up to max_tokens."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 513, 16))
    size = 1024
    while size <= max_tokens:
        sizes.append(size)
        size *= 2
    sizes = [s for s in sizes if s <= max_tokens]
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


def sparse_buckets(max_tokens: int) -> list[int]:
    """Powers of two to 256, then 1.5x steps (384, 512, 768, 1024, 1536, 2048, ...) up to max_tokens.

    full_and_piecewise's default: there decode-only steps replay full graphs, so the piecewise
    graphs serve only prefill and mixed steps, where padding is cheap (up to ~256 tokens a 0.6B
    step is bound by reading the weights, so padding to the next power of two costs little; above,
    a 1.5x step wastes at most a third). 14 buckets instead of default_buckets' 53 at 2048: at
    Qwen3-0.6B's 29 pieces per bucket, 406 piece graphs to capture instead of 1,537."""
    sizes, size = [], 1
    while size <= min(max_tokens, 256):
        sizes.append(size)
        size *= 2
    size = 256
    while size * 3 // 2 <= max_tokens:
        sizes.append(size * 3 // 2)
        if size * 2 <= max_tokens:
            sizes.append(size * 2)
        size *= 2
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


@dataclass
class EngineConfig:
    model: str | None = None             # HF checkpoint directory; None -> the bundled tiny model
    device: str = "auto"                 # "auto" (cuda if available), "cpu", "cuda", "cuda:N"
    dtype: str = "auto"                  # "auto" (bf16 on CUDA, fp32 on CPU), "bfloat16", "float16", "float32"
    block_size: int = 16
    num_kv_blocks: int | None = None     # None -> from gpu_memory_utilization (CUDA) or cpu_kv_blocks
    gpu_memory_utilization: float = 0.85
    cpu_kv_blocks: int = 512
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None     # None -> min(config's max_position_embeddings, 4096)
    mode: str = "auto"                   # one of MODES, or "auto" (full_and_piecewise on CUDA, eager on CPU)
    attention_backend: str = "auto"      # "auto", "torch", "triton"
    fuse: bool = True                    # fuse Q/K/V and gate/up at load
    kernels: bool | None = None          # Triton norm/activation/MoE kernels (None: on CUDA)
    enable_prefix_caching: bool = True
    async_scheduling: bool | None = None  # None -> on for CUDA
    seed: int = 0
    # Token-count buckets for piecewise graphs. None: default_buckets (dense) in piecewise mode,
    # sparse_buckets in full_and_piecewise, where decode-only steps take the full graphs.
    cudagraph_buckets: list[int] | None = None
    decode_buckets: list[int] | None = None      # batch buckets for full decode graphs
    # Largest piecewise bucket. As large as the default step budget: a 2048-token chunked-prefill
    # step run compiled but ungraphed cost ~32 ms of host launches on the H200 against ~8 ms of GPU
    # work (P2's prefill phase, docs/PERF.md); in its graphs only the attention launches remain.
    max_capture_tokens: int = 2048
    compile_cache: bool = True
    compile_cache_dir: str | None = None
    show_progress: bool = False
    kernel_warmup: bool | None = None    # compile every Triton kernel variant at start-up (None: on CUDA)
    gc_freeze: bool = True               # freeze start-up's objects out of the GC's reach (engine/gc_freeze.py)

    def __post_init__(self):
        # numpy's scalars (a size computed with numpy, a fraction read from an array) as the plain
        # Python numbers they stand for: the checks below, and everything downstream, take those.
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, np.generic):
                if isinstance(v, np.bool_):
                    setattr(self, f.name, bool(v))
                elif isinstance(v, np.integer):
                    setattr(self, f.name, int(v))
                elif isinstance(v, np.floating):
                    setattr(self, f.name, float(v))

        def check(name, ok, allowed):
            if not ok:
                raise ConfigError(name, f"got {getattr(self, name)!r}; allowed: {allowed}")

        def is_int(v):   # True and False are ints to Python; not a count or a size here
            return isinstance(v, int) and not isinstance(v, bool)

        def is_real(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool)
        # A checkpoint directory: "" (or blank) named the working directory without a word.
        check("model", self.model is None or isinstance(self.model, os.PathLike)
              or (isinstance(self.model, str) and self.model.strip() != ""),
              "None (the bundled tiny model) or a checkpoint directory path")
        check("block_size", is_int(self.block_size) and self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
              "a power of two from 1 to 128")
        # Block 0 is the scratch block; the others must hold the smallest request, a 1-token prompt
        # and the token it makes (Scheduler.check_request): with block_size 1, two blocks held one
        # token, and the engine started only to refuse every request ("at most 0 prompt tokens").
        least = 3 if self.block_size == 1 else 2
        at_least = (f"{least}" if least == 2 else f"{least} with block_size 1 (block 0 is scratch; the others "
                                                  "must hold 2 tokens: a 1-token prompt and one new token)")
        check("num_kv_blocks", self.num_kv_blocks is None or (is_int(self.num_kv_blocks)
                                                                and self.num_kv_blocks >= least),
              f"None or an int >= {at_least}")
        check("gpu_memory_utilization", is_real(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1,
              "a number in (0, 1]")
        check("cpu_kv_blocks", is_int(self.cpu_kv_blocks) and self.cpu_kv_blocks >= least, f"an int >= {at_least}")
        check("max_num_seqs", is_int(self.max_num_seqs) and 1 <= self.max_num_seqs <= MAX_NUM_SEQS,
              f"1..{MAX_NUM_SEQS}")
        check("max_num_batched_tokens", is_int(self.max_num_batched_tokens)
              and 1 <= self.max_num_batched_tokens <= MAX_NUM_BATCHED_TOKENS, f"1..{MAX_NUM_BATCHED_TOKENS}")
        check("max_model_len", self.max_model_len is None or (is_int(self.max_model_len)
                                                                and self.max_model_len >= 2), "None or an int >= 2")
        check("device", isinstance(self.device, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
              "auto, cpu, cuda or cuda:N")
        check("mode", self.mode in MODES + ("auto",), f"{', '.join(MODES)} or auto")
        check("attention_backend", self.attention_backend in ("auto", "torch", "triton"), "auto, torch, triton")
        check("dtype", self.dtype in ("auto", "bfloat16", "float16", "float32", "bf16", "fp16", "fp32"),
              "auto, bfloat16, float16, float32 (or bf16, fp16, fp32)")
        check("max_capture_tokens", is_int(self.max_capture_tokens) and self.max_capture_tokens >= 1,
              "an int >= 1")
        check("kernel_warmup", self.kernel_warmup is None or isinstance(self.kernel_warmup, bool),
              "None, True or False")
        for name in ("fuse", "enable_prefix_caching", "compile_cache", "show_progress", "gc_freeze"):
            check(name, isinstance(getattr(self, name), bool), "True or False")
        for name in ("kernels", "async_scheduling"):
            check(name, getattr(self, name) is None or isinstance(getattr(self, name), bool), "None, True or False")
        # The kernels are switched on by the fuse transform (models/fuse.py): kernels=True with
        # fuse=False loaded the model without them, without a word (a kernels-vs-reference comparison
        # then compared the reference with itself, the MoE's grouped GEMM never ran).
        check("kernels", not (self.kernels and not self.fuse), KERNELS_WITHOUT_FUSE)
        # torch.manual_seed's range
        check("seed", is_int(self.seed) and -2**63 <= self.seed < 2**64, "an int in [-2**63, 2**64)")
        # Blank: "" (an unset shell variable, `--compile-cache-dir "$DIR"`) is Path("."), and a compiled
        # mode wrote its cache entries into the working directory without a word, as with model.
        check("compile_cache_dir", self.compile_cache_dir is None or isinstance(self.compile_cache_dir, os.PathLike)
              or (isinstance(self.compile_cache_dir, str) and self.compile_cache_dir.strip() != ""),
              "None or a directory path (not blank)")
        for name in ("cudagraph_buckets", "decode_buckets"):
            value = getattr(self, name)
            check(name, value is None or (isinstance(value, (list, tuple)) and len(value) > 0
                                          and all(is_int(b) and b >= 1 for b in value)),
                  "None or a non-empty list of ints >= 1")
        # A bucket no step can reach would be dropped, or captured and never replayed, without a
        # word: the scheduler gives a step at most max_num_batched_tokens tokens (a decode costs one
        # of them), so a decode batch holds at most min(max_num_seqs, max_num_batched_tokens).
        for name, limit, by in (("cudagraph_buckets", self.max_num_batched_tokens, "max_num_batched_tokens"),
                                ("decode_buckets", min(self.max_num_seqs, self.max_num_batched_tokens),
                                 "min(max_num_seqs, max_num_batched_tokens)")):
            beyond = [b for b in getattr(self, name) or () if b > limit]
            check(name, not beyond, f"buckets in 1..{limit} ({by}); {beyond} can never be used")

    def check_settings_used(self, device_type: str, mode: str) -> None:
        """Settings given (not at their defaults) that this engine never reads were ignored without
        a word. Two that contradict each other in one config (a KV size from num_kv_blocks and from
        a fraction or a CPU count) are refused, as on the command line (check_kv_sizing_flags). One
        that only this device or mode leaves unread gets a warning naming what decides instead, not
        an error: one config that runs every mode or device (the benchmarks' --modes, tests that
        compare modes) stays valid."""
        def given(name):
            return getattr(self, name) != getattr(EngineConfig, name)
        if self.num_kv_blocks is not None:
            for name in ("gpu_memory_utilization", "cpu_kv_blocks"):
                if given(name):
                    raise ConfigError(name, f"got {getattr(self, name)!r}, which has no effect with num_kv_blocks "
                                            f"({self.num_kv_blocks}), which sets the KV cache's size: give one of "
                                            f"the two")
        unread = []
        if given("gpu_memory_utilization") and device_type != "cuda":
            unread.append(f"gpu_memory_utilization={self.gpu_memory_utilization!r} has no effect on {device_type} "
                          f"(the KV cache has cpu_kv_blocks={self.cpu_kv_blocks} blocks there)")
        if given("cpu_kv_blocks") and device_type == "cuda" and self.num_kv_blocks is None:
            unread.append(f"cpu_kv_blocks={self.cpu_kv_blocks!r} has no effect on CUDA (gpu_memory_utilization="
                          f"{self.gpu_memory_utilization} sizes the KV cache there)")
        if given("max_capture_tokens"):
            if mode not in COMPILED_MODES:
                unread.append(f"max_capture_tokens={self.max_capture_tokens!r} has no effect in mode {mode!r}, "
                              f"which compiles nothing (it bounds {', '.join(COMPILED_MODES)})")
            elif self.cudagraph_buckets is not None:
                unread.append(f"max_capture_tokens={self.max_capture_tokens!r} has no effect with "
                              f"cudagraph_buckets (the largest bucket, {max(self.cudagraph_buckets)}, bounds the "
                              f"graphs)")
        # Bucket lists were refused in a mode that never reads them (an error), which broke the rule
        # above: a config with decode_buckets could not run --modes eager,full_decode.
        for name, modes in BUCKET_MODES.items():
            if getattr(self, name) is not None and mode not in modes:
                how = f"mode {mode!r}" if self.mode == mode else f"mode {self.mode!r}, which runs {mode!r} here"
                unread.append(f"{name}={getattr(self, name)!r} has no effect in {how} (it shapes the graphs of "
                              f"{' and '.join(modes)})")
        if mode not in COMPILED_MODES:
            for name in ("compile_cache", "compile_cache_dir"):
                if given(name):
                    unread.append(f"{name}={getattr(self, name)!r} has no effect in mode {mode!r}, which compiles "
                                  f"nothing (the compile cache serves {', '.join(COMPILED_MODES)})")
        for message in unread:
            warnings.warn(f"EngineConfig: {message}", UserWarning, stacklevel=2)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        for key in kwargs:
            if key not in names:
                raise ConfigError(key, f"unknown EngineConfig field; allowed: {', '.join(sorted(names))}")
        return cls(**kwargs)

    def resolved_device(self) -> str:
        import torch
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("device", f"{self.device!r} asked for but CUDA is not available; use 'cpu'")
        if self.device.startswith("cuda:") and int(self.device[5:]) >= torch.cuda.device_count():
            raise ConfigError("device", f"got {self.device!r}; allowed: cuda:0..cuda:{torch.cuda.device_count() - 1}")
        return self.device

    def check_triton_usable(self, device_type: str) -> None:
        """Triton launches need a GPU, or its CPU interpreter (TRITON_INTERPRET=1, read when triton
        is imported; the tests set it). Without either, the first launch failed deep in Triton with
        "0 active drivers", after the weights were loaded."""
        from pcg_engine.kernels import triton_interpreting   # Triton's own reading of the variable
        if device_type == "cuda" or triton_interpreting():
            return
        if self.attention_backend == "triton":
            raise ConfigError("attention_backend", f"'triton' needs a CUDA device (or Triton's CPU interpreter, "
                                                   f"TRITON_INTERPRET=1); on {device_type} allowed: auto, torch")
        if self.kernels:
            raise ConfigError("kernels", f"True runs Triton kernels, which need a CUDA device (or Triton's CPU "
                                         f"interpreter, TRITON_INTERPRET=1); on {device_type} allowed: None, False")

    def resolved_attention_backend(self, device_type: str) -> str:
        """'auto' -> 'triton' on CUDA, 'torch' elsewhere."""
        if self.attention_backend == "auto":
            return "triton" if device_type == "cuda" else "torch"
        return self.attention_backend

    def check_mode_backend(self, device_type: str) -> None:
        """The full-graph modes replay whole-step CUDA graphs, attention included: only a graph-safe
        backend (attention/triton_backend.py's cuda_graph_safe; torch_backend reads host values per
        step) can run in them. Checked by ModelRunner and, before any engine is built, by the
        benchmarks' --modes (bench/common.check_modes)."""
        mode, backend = self.resolved_mode(device_type), self.resolved_attention_backend(device_type)
        if mode in BUCKET_MODES["decode_buckets"] and backend != "triton":
            raise ConfigError("mode", f"{mode!r} replays whole-step CUDA graphs and needs a graph-safe attention "
                                      f"backend; {backend!r} is not; allowed with it: eager, compile, piecewise "
                                      f"(or attention_backend='triton'"
                                      + (", which on the CPU needs TRITON_INTERPRET=1)" if device_type != "cuda" else ")"))

    def resolved_mode(self, device_type: str) -> str:
        if self.mode == "auto":
            return "full_and_piecewise" if device_type == "cuda" else "eager"
        return self.mode

    def resolved_max_model_len(self, max_position_embeddings: int) -> int:
        """max_model_len, or the checkpoint's max_position_embeddings capped at 4096."""
        return self.max_model_len or min(max_position_embeddings, 4096)

    def resolved_kernels(self, device_type: str) -> bool:
        """kernels, None -> on for CUDA."""
        return self.kernels if self.kernels is not None else device_type == "cuda"

    def resolved_async(self, device_type: str) -> bool:
        return device_type == "cuda" if self.async_scheduling is None else bool(self.async_scheduling)

    def torch_dtype(self, device_type: str):
        import torch
        table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                 "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}
        if self.dtype == "auto":
            return torch.bfloat16 if device_type == "cuda" else torch.float32
        return table[self.dtype]


# The help of the engine's settings as command-line flags, one text for `pcg generate` and `pcg bench`
# (the benchmarks' flags had none, so their --help did not say what an unset one does).
FLAG_HELP = {
    "max_model_len": "default: the checkpoint's max_position_embeddings, at most 4096",
    "max_num_batched_tokens": f"tokens a step may hold, 1..{MAX_NUM_BATCHED_TOKENS} "
                              f"(default {EngineConfig.max_num_batched_tokens})",
    "block_size": f"tokens a KV block holds, a power of two from 1 to 128 (default {EngineConfig.block_size})",
    "gpu_memory_utilization": "in (0, 1]: share of the GPU's memory the engine may fill, KV cache included; sizes "
                              "the KV cache on CUDA when --num-kv-blocks is not given "
                              f"(default {EngineConfig.gpu_memory_utilization}); refused on the CPU and beside "
                              "--num-kv-blocks",
    "attention_backend": "auto, torch, triton (default auto: triton on CUDA, torch on the CPU)",
}


def num_kv_blocks_help(block_size: str = "--block-size") -> str:
    """--num-kv-blocks' help. No fixed size in it: the block size and --gpu-memory-utilization set
    it. `block_size`: how the command names the block's tokens (the benchmarks, which have no
    --block-size flag, give the default's number)."""
    return (f"KV cache blocks of {block_size} tokens (default: what --gpu-memory-utilization of the GPU's memory "
            f"leaves; {EngineConfig.cpu_kv_blocks} on the CPU)")


def check_kv_sizing_flags(device: str, num_kv_blocks, gpu_memory_utilization) -> None:
    """For the command line, which knows the settings the user gave (None: not given):
    gpu_memory_utilization sizes the KV cache only on CUDA and only where num_kv_blocks is not set,
    so a given value that the engine would ignore without a word is refused instead."""
    if gpu_memory_utilization is None:
        return
    if num_kv_blocks is not None:
        raise ConfigError("gpu_memory_utilization", "has no effect with --num-kv-blocks, which sets the KV "
                                                    "cache's size: give one of the two")
    import torch
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        raise ConfigError("gpu_memory_utilization", "sizes the KV cache on CUDA only; on the CPU the cache "
                                                    f"has --num-kv-blocks blocks (default {EngineConfig.cpu_kv_blocks})")


__all__ = ["EngineConfig", "check_kv_sizing_flags", "FLAG_HELP", "num_kv_blocks_help", "MODES", "COMPILED_MODES", "BUCKET_MODES", "CAPTURING_MODES", "MAX_NUM_BATCHED_TOKENS", "default_buckets", "sparse_buckets",
           "field"]
