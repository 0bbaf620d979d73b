"""The model runner: owns the model, its KV cache and the attention backend, and runs one step.

A step arrives as [(request, num_new_tokens)]. The runner builds the flat batch from the
persistent input batch, picks how to run it (DESIGN.md, "Modes") and returns the logits of the rows
that sample:

  eager               the model as written
  compile             Inductor-compiled whole model, no graphs
  piecewise           graph split at attention, pieces compiled and replayed as CUDA graphs per
                      token-count bucket (the step padded to its bucket), attention eager between
  full_decode         decode-only steps replay one graph of the whole forward per batch bucket;
                      other steps run eagerly
  full_and_piecewise  full graphs for decode-only steps, piecewise for the rest (the CUDA default)

After the mode's set-up the runner warms up the kernels (engine/warmup.py, on by default on CUDA):
dummy steps that compile every Triton variant the steps can select, so none compiles mid-serving.
"""

import contextlib
import math
import time

import torch

from pcg_engine.attention.backend import kv_cache_shape, make_backend
from pcg_engine.attention.context import ForwardContext, set_forward_context
from pcg_engine.attention.op import bind_kv_caches
from pcg_engine.attention.rope import rope_cache
from pcg_engine.config import CAPTURING_MODES, EngineConfig, default_buckets
from pcg_engine.engine.input_batch import InputBatch, StepInputs
from pcg_engine.engine import precompile
from pcg_engine.engine.precompile import VariantCounter
from pcg_engine.errors import ConfigError
from pcg_engine.models.loader import load_config, load_model
from pcg_engine.models.qwen3 import is_moe_layer


def _check_max_model_len(config: EngineConfig, model_path) -> None:
    """max_model_len beyond the checkpoint's max_position_embeddings: positions the model was not
    trained for (this engine applies plain RoPE, no scaling), and per-row buffers sized for them."""
    if config.max_model_len is None:
        return
    limit = load_config(model_path).max_position_embeddings
    if config.max_model_len > limit:
        raise ConfigError("max_model_len", f"got {config.max_model_len}; allowed: 2..{limit} (the checkpoint's "
                                           "max_position_embeddings)")


def _check_moe_reference_in_graphs(config: EngineConfig, model_path, device_type: str) -> None:
    """A MoE model without the Triton kernels runs its experts through the reference op
    (models/moe.py), which reads the routing back to the host (bincount().tolist()): a sync that a
    CUDA graph capture forbids. The start died deep in the capture with a CUDA error; refused
    here, before the weights load, naming the setting."""
    mode = config.resolved_mode(device_type)
    if device_type != "cuda" or mode not in CAPTURING_MODES or (config.resolved_kernels(device_type) and config.fuse):
        return
    hf = load_config(model_path)
    if not any(is_moe_layer(hf, i) for i in range(hf.num_hidden_layers)):
        return
    field, value = ("fuse", False) if not config.fuse else ("kernels", False)
    raise ConfigError(field, f"got {value}: a MoE model then runs its experts through the reference path, which "
                             f"reads the routing back to the host, and mode {mode!r} captures CUDA graphs, which "
                             f"forbid that; allowed with this mode: kernels None or True with fuse True (or mode "
                             f"eager or compile)")


KV_HEADROOM = 512 * 2**20     # bytes left free beside the KV cache (allocator slack, small buffers)


def kv_blocks_for(utilization: float, total: int, peak: int, used_by_others: int, per_block: int) -> int:
    """KV blocks that fit in `utilization` of the device's `total` bytes beside the model's measured
    peak, what other processes use and KV_HEADROOM. Fewer than 2 (one usable, one scratch) is a
    ConfigError on gpu_memory_utilization naming the smallest fraction that gives two."""
    blocks = int((total * utilization - peak - used_by_others - KV_HEADROOM) // per_block)
    if blocks < 2:
        needed = (peak + used_by_others + KV_HEADROOM + 2 * per_block) / total
        allowed = (f"at least {needed:.3f} (up to 1.0)" if needed <= 1 else
                   "none on this device: the model's peak and other processes leave no room; free the device "
                   "or use a smaller max_num_batched_tokens")
        raise ConfigError("gpu_memory_utilization", f"{utilization} of {total / 2**30:.1f} GiB leaves no room for "
                                                    f"the KV cache (model peak {peak / 2**30:.1f} GiB, other "
                                                    f"processes {used_by_others / 2**30:.1f} GiB); allowed: {allowed}")
    return blocks


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path, device: torch.device, progress=None):
        self.config = config
        self.device = device
        self.timings: dict[str, float] = {}
        _check_max_model_len(config, model_path)   # before the weights: config.json alone decides
        _check_moe_reference_in_graphs(config, model_path, device.type)
        config.check_triton_usable(device.type)
        config.check_settings_used(device.type, config.resolved_mode(device.type))
        self.dtype = config.torch_dtype(device.type)
        t0 = time.perf_counter()
        if device.type == "cuda":    # the CUDA context: seconds on a first use, not weight loading
            torch.zeros(1, device=device)
            torch.cuda.synchronize(device)
        self.timings["device_init_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.model = load_model(model_path, device=device, dtype=self.dtype, fuse=config.fuse,
                                kernels=config.resolved_kernels(device.type))
        self.timings["weight_load_s"] = time.perf_counter() - t0
        hf = self.model.config
        self.hf_config = hf
        self.vocab_size = hf.vocab_size
        self.max_model_len = config.resolved_max_model_len(hf.max_position_embeddings)
        self.num_layers = hf.num_hidden_layers
        self.num_heads, self.num_kv_heads = hf.num_attention_heads, hf.num_key_value_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // self.num_heads
        self.block_size = config.block_size
        self.mode = config.resolved_mode(device.type)
        theta = getattr(hf, "rope_theta", None) or (getattr(hf, "rope_parameters", None) or {}).get("rope_theta", 1e6)
        self.cos_sin = rope_cache(self.head_dim, max(self.max_model_len, 2), theta, device=device)
        config.check_mode_backend(device.type)
        self.backend = make_backend(config.resolved_attention_backend(device.type), num_heads=self.num_heads,
                                    num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                    block_size=self.block_size, cos_sin=self.cos_sin)
        # The scheduler gives no step more than its token budget (a decode costs one token of it),
        # and buckets stop there too (compile/setup.py): the buffers, the KV sizing forward and the
        # kernel warm-up need no more. (max(budget, max_num_seqs) sized them for steps that never run.)
        self.max_num_tokens = config.max_num_batched_tokens
        self.batch = InputBatch(config.max_num_seqs, self.max_model_len, self.block_size, self.max_num_tokens,
                                device, host_metadata=self.backend.name != "triton")   # torch_backend.py reads them
        self.forward_fn = self.model.forward     # the mode's set-up may replace these three
        self.token_buckets: list[int] = []
        self.full_graphs = None
        # Triton variants made from here on (engine/precompile.py): late_variants, those made after
        # the pre-compile's compiles were waited for, are what it missed. The try: compiles begun in
        # the background (from the KV sizing on) are waited for and their threads ended whatever
        # happens, also where no pass took them over (no warm-up) or the start-up fails.
        self.variant_counter = VariantCounter()
        with self.variant_counter:
            try:
                self._allocate_kv_caches()
                self._setup_mode(progress)
                self._warm_up(progress)
            finally:
                precompile.finish(self, getattr(self, "precompile_background", None))
        after = getattr(self, "variants_after_precompile", None)
        if after is not None:
            self.timings["late_variants"] = float(self.variant_counter.count - after)

    def _allocate_kv_caches(self) -> None:
        t0 = time.perf_counter()
        self.num_kv_blocks = self._num_kv_blocks()
        shape = kv_cache_shape(self.num_kv_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        try:
            self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        except RuntimeError as e:      # torch.OutOfMemoryError, or the CPU allocator's enforce failure
            self.kv_caches = None
            field = ("num_kv_blocks" if self.config.num_kv_blocks is not None else
                     "cpu_kv_blocks" if self.device.type != "cuda" else "gpu_memory_utilization")
            per_block = self.kv_bytes_per_block
            raise ConfigError(field, f"{self.num_kv_blocks} KV blocks of {per_block} bytes each "
                                     f"({self.num_kv_blocks * per_block / 2**30:.1f} GiB) cannot be allocated on "
                                     f"{self.device}; allowed: as many as its free memory holds "
                                     f"({str(e).splitlines()[0]})") from None
        self.timings["kv_cache_s"] = time.perf_counter() - t0    # sizing forward (CUDA) + allocation
        # Each attention module holds its layer's cache (a buffer: a graph input to the compiled
        # pieces, at this fixed address for the runner's life). Bound before any trace.
        bind_kv_caches(self.model, self.kv_caches)

    def close(self) -> None:
        """Release the device memory this runner holds (KV cache, graphs and their pool, compiled
        pieces, weights, static buffers). A process that builds several engines one after another
        (the benchmarks' --modes) calls this, so the next engine's KV sizing sees a free GPU
        whatever references to the old engine remain."""
        if getattr(self, "model", None) is not None:   # the modules hold the caches too
            bind_kv_caches(self.model, None)
        if getattr(self, "graph_pool", None) is not None:   # so do replay programs
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)   # no replay of a graph it drops still running
            self.graph_pool.release()
        for name in ("full_graphs", "graph_pool", "forward_fn", "kv_caches", "model", "batch", "cos_sin"):
            if hasattr(self, name):
                setattr(self, name, None)
        # compile_cache=False's scratch directory for Inductor and Triton (compile/setup.py): it
        # outlived close() until the runner was collected (one directory per closed engine that a
        # server kept). The start-up's compile threads are done by now (precompile.finish).
        scratch = getattr(self, "compile_scratch", None)
        if scratch is not None:
            scratch.cleanup()
            self.compile_scratch = None
        import gc
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # ---- set-up ------------------------------------------------------------------------------
    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type != "cuda":
            return self.config.cpu_kv_blocks
        # Profile a forward at the largest step (attention skipped: no metadata), then give the
        # KV cache what the memory fraction leaves.
        try:
            peak = self._profile_peak()
        except torch.OutOfMemoryError:
            raise self._profile_oom_error() from None
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        return kv_blocks_for(self.config.gpu_memory_utilization, total, peak, used_by_others, self.kv_bytes_per_block)

    def _profile_peak(self) -> int:
        """Peak allocated bytes of one forward at max_num_batched_tokens tokens (CUDA)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        T = self.max_num_tokens
        ids = torch.zeros(T, dtype=torch.long, device=self.device)
        # On a start that compiles Triton kernels, they only compile here, in the background
        # (engine/precompile.py): the peak is the torch ops' allocations, which run.
        background = precompile.begin(self)
        with torch.inference_mode(), set_forward_context(ForwardContext(None, [], self.backend)), \
                (background.compiling() if background is not None else contextlib.nullcontext()):
            hidden = self.model(ids, ids)
            self.model.compute_logits(hidden[: self.config.max_num_seqs])
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def _profile_oom_error(self) -> ConfigError:
        """The profile forward itself did not fit: a step of max_num_batched_tokens tokens cannot run
        beside the weights on this device (it failed inside torch's allocator, naming no setting)."""
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return ConfigError("max_num_batched_tokens", f"a step of {self.max_num_tokens} tokens ran out of GPU memory "
                                                     f"beside the weights ({free / 2**30:.1f} of {total / 2**30:.1f} "
                                                     "GiB free after it); allowed: a smaller value, or a device "
                                                     "with more free memory")

    @property
    def kv_bytes_per_block(self) -> int:
        """Device bytes of one KV block: K and V, every layer (kv_cache_shape with one block)."""
        shape = kv_cache_shape(1, self.block_size, self.num_kv_heads, self.head_dim)
        return math.prod(shape) * self.dtype.itemsize * self.num_layers

    def _setup_mode(self, progress):
        mode = self.mode
        if mode == "eager":
            return
        from pcg_engine.compile.setup import setup_compiled_modes
        setup_compiled_modes(self, progress)

    def warmup_enabled(self) -> bool:
        """kernel_warmup, whose default (None) is: on CUDA."""
        enabled = self.config.kernel_warmup
        return self.device.type == "cuda" if enabled is None else bool(enabled)

    def _warm_up(self, progress):
        """Compile every kernel variant now rather than in the middle of the first steps (see
        engine/warmup.py). After the mode's set-up, so the dummy steps take the path real ones will;
        off by default on the CPU, where the torch backend compiles nothing."""
        if not self.warmup_enabled():
            return
        from pcg_engine.engine.warmup import has_jit_kernels, warm_up
        if not has_jit_kernels(self) and self.config.kernel_warmup:
            # Asked for, and nothing here compiles: it was skipped without a word.
            import warnings
            warnings.warn(f"EngineConfig: kernel_warmup=True has no effect here: this engine compiles no kernels "
                          f"(attention backend {self.backend.name!r}, no fused Triton kernels on "
                          f"{self.device.type})", UserWarning, stacklevel=2)
        if has_jit_kernels(self):
            precompile.precompile(self)   # eager mode's (the compiled modes ran it before capture)
            try:
                warm_up(self, progress)
            except Exception as e:   # a serving engine still starts: the kernels compile on first use
                import warnings
                warnings.warn(f"kernel warm-up failed, kernels will compile on first use: {e!r}")
                self.timings["warmup_failed"] = 1.0

    # ---- one step ----------------------------------------------------------------------------
    def context(self, inputs: StepInputs) -> ForwardContext:
        return ForwardContext(inputs.metadata, self.kv_caches, self.backend)

    def pick_padding(self, scheduled) -> tuple[int | None, int | None, str]:
        """(pad_tokens_to, pad_reqs_to, path) for this step under the current mode."""
        R = len(scheduled)
        if getattr(scheduled, "seq_lens", None) is not None:     # an all-decode ScheduledBatch
            T = R
        else:
            num_new = getattr(scheduled, "num_new", None)
            T = int(num_new.sum()) if num_new is not None else sum(n for _, n in scheduled)
        if self.full_graphs is not None and T == R:
            size = self.full_graphs.bucket_for(R)
            if size is not None:
                return size, size, "full"
        if self.token_buckets and T <= self.token_buckets[-1]:
            size = next(b for b in self.token_buckets if b >= T)
            return size, None, "piecewise"
        return None, None, "compiled" if self.forward_fn != self.model.forward else "eager"

    @torch.inference_mode()
    def execute(self, scheduled, previous_tokens: torch.Tensor | None = None):
        """Run one step. Returns (logits [S, V] of the sampling rows, model dtype; StepInputs)."""
        pad_t, pad_r, path = self.pick_padding(scheduled)
        inputs = self.batch.prepare(scheduled, pad_tokens_to=pad_t, pad_reqs_to=pad_r,
                                    previous_tokens=previous_tokens)
        self.last_path = path
        if path == "full":
            hidden = self.full_graphs.run(inputs, self)
        else:
            with set_forward_context(self.context(inputs)):
                hidden = self.forward_fn(inputs.input_ids, inputs.positions)
        # An all-decode step samples its first rows in order: a view, no gather kernel.
        rows = hidden[:inputs.num_real_reqs] if inputs.logits_in_order else hidden.index_select(0, inputs.logits_indices)
        logits = self.model.compute_logits(rows)
        return logits, inputs


__all__ = ["ModelRunner", "default_buckets"]
