"""Wiring the compiled modes into a ModelRunner (called for every mode except 'eager').

  compile             forward_fn = CompiledForward(split=False): the whole forward through Inductor
  piecewise           forward_fn = CompiledForward(split=True) with a CUDA graph per piece and token
                      bucket; token_buckets tells the runner what to pad to
  full_decode         full_graphs = FullDecodeGraphs over the eager model; prefill stays eager
  full_and_piecewise  both

Token buckets start at 1: the compiled forward's token dim is unbacked (compile/piecewise.py), so
a one-token step runs the one trace unpadded (it used to be padded to two tokens, since a dynamic
dim is specialised at 1 and would have retraced). 'compile' pads nothing (token_buckets = []). In
full_and_piecewise the piecewise buckets start at 2: a one-token step is a single decode, which
always takes a full decode graph there, so piece graphs at 1 would never replay.

On the CPU everything but capture runs: split, compiled pieces, bucket padding, the compile cache.
On CUDA the compiled forward runs once at the largest bucket (Dynamo + Inductor), then every bucket
is captured largest first into one shared pool: the piecewise graphs, then the full decode graphs.
"""

import errno
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch

from pcg_engine.attention.context import ForwardContext, set_forward_context
from pcg_engine.attention.metadata import AttentionMetadata
from pcg_engine.compile import saved_trace
from pcg_engine.compile.cache import (CompileCache, CompileCacheError, cache_fields, inductor_cache_counters,
                                      no_cache)
from pcg_engine.compile.cuda_graph import GraphPool
from pcg_engine.compile.full_graph import FullDecodeGraphs, default_decode_buckets
from pcg_engine.compile.piecewise import MIN_TRACED_TOKENS, CompiledForward
from pcg_engine.config import BUCKET_MODES, COMPILED_MODES, default_buckets, sparse_buckets
from pcg_engine.engine import precompile

PIECEWISE_MODES = BUCKET_MODES["cudagraph_buckets"]
FULL_MODES = BUCKET_MODES["decode_buckets"]        # ("full_decode", "full_and_piecewise")


def token_buckets_for(runner) -> list[int]:
    config = runner.config
    # No step holds more than max_num_batched_tokens tokens (the scheduler's budget; a decode costs
    # one): buckets above it were captured and never replayed.
    limit = config.max_num_batched_tokens
    # In full_and_piecewise, decode-only steps replay full graphs: the piecewise buckets serve only
    # prefill and mixed steps, and a sparser list captures a third of the graphs (config.sparse_buckets).
    default = sparse_buckets if runner.mode == "full_and_piecewise" else default_buckets
    wanted = config.cudagraph_buckets or default(min(config.max_capture_tokens, limit))
    # A one-token step is one decode (T == R == 1): full_and_piecewise replays a full graph for it.
    lowest = 2 if runner.mode == "full_and_piecewise" else MIN_TRACED_TOKENS
    clamped = {max(b, lowest) for b in wanted}
    return sorted(b for b in clamped if b <= limit)


def dummy_metadata(runner, num_tokens: int) -> AttentionMetadata:
    """A step of num_tokens padding tokens and no request, over the runner's static buffers.

    The KV write runs inside the captured pieces, so a capture must see the real slot buffer (the
    address every later step of the bucket uses) holding slots the write may touch: -1 sends every
    token to the scratch block. No request means attention writes zeros."""
    b = runner.batch
    b.input_ids[:num_tokens].zero_()
    b.positions[:num_tokens].zero_()
    b.slot_mapping[:num_tokens].fill_(-1)
    b.query_start_loc[:1].zero_()
    return AttentionMetadata(
        query_start_loc=b.query_start_loc[:1], seq_lens=b.seq_lens[:0], block_table=b.step_block_table[:0],
        slot_mapping=b.slot_mapping[:num_tokens], num_reqs=0, num_tokens=num_tokens, max_query_len=0,
        max_seq_len=0, query_start_loc_cpu=torch.zeros(1, dtype=torch.int32),
        seq_lens_cpu=torch.zeros(0, dtype=torch.int32))


def _dummy_forward(runner, forward, num_tokens: int):
    """A forward over the static buffers with no requests (dummy_metadata)."""
    b = runner.batch
    meta = dummy_metadata(runner, num_tokens)
    with set_forward_context(ForwardContext(meta, runner.kv_caches, runner.backend)):
        return forward(b.input_ids[:num_tokens], b.positions[:num_tokens])


def _progress_task(progress, description, total):
    if progress is None:
        return None
    return progress.add_task(description, total=total)


@torch.inference_mode()
def capture_piecewise(runner, forward: CompiledForward, buckets, progress=None) -> float:
    """One dummy forward per bucket, largest first, inside the pool's capture phase."""
    pool = forward.graphs
    t0 = time.perf_counter()
    task = _progress_task(progress, "piecewise CUDA graphs", len(buckets))
    with pool.capture_phase():
        for bucket in sorted(buckets, reverse=True):
            _dummy_forward(runner, forward, bucket)
            if task is not None:
                progress.advance(task)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - t0


def _without_cache(runner):
    runner.timings["compile_cache_hit"] = 0.0
    # Inductor's and Triton's directories for this start (cache.no_cache): mkdtemp makes it
    # 0700. Removed with the runner (or at exit), not when the set-up ends: compiles begun
    # meanwhile in precompile's threads may still write to it.
    runner.compile_scratch = tempfile.TemporaryDirectory(prefix="pcg-compile-")
    return None, no_cache(Path(runner.compile_scratch.name))


def _open_cache(runner, buckets, decode_buckets):
    if not runner.config.compile_cache:
        return _without_cache(runner)
    cache = CompileCache(runner.config.compile_cache_dir, cache_fields(runner, buckets, decode_buckets))
    try:
        state = cache.open()
    except CompileCacheError as e:
        if not e.unwritable:      # a directory others could write, a file: refused, the start stops
            raise
        # The cache only saves time: a directory this user cannot write (a read-only mount) does
        # not stop the start, which compiles as with compile_cache=False and says so.
        warnings.warn(f"{e}; starting without the compile cache (nothing saved)")
        runner.timings["compile_cache_unwritable"] = 1.0
        return _without_cache(runner)
    runner.timings["compile_cache_hit"] = 1.0 if state == "hit" else 0.0
    runner.timings["compile_cache_rebuilt"] = 1.0 if cache.rejected else 0.0
    runner.compile_cache = cache
    return cache, cache.activate()


# A C++ compiler run by Inductor that fails to write its output raises these, without an errno.
_COMPILER_FAILURES = ("CppCompileError", "CalledProcessError")


def _out_of_space(error: BaseException, where: Path) -> bool:
    """Whether a compile failed because the disk under the cache is full: an ENOSPC / EDQUOT
    OSError among the error's causes, or a compiler subprocess's failure (no errno) with less than
    1 MiB left there. Any other error (a model bug, out of GPU memory) is not, however full the
    disk: it is raised as it is."""
    seen, compiler = set(), False
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        compiler = compiler or type(error).__name__ in _COMPILER_FAILURES
        error = error.__cause__ or error.__context__
    if not compiler:
        return False
    try:
        return shutil.disk_usage(where).free < (1 << 20)
    except OSError:
        return False


def _trace_and_compile(runner, forward: CompiledForward, buckets, decode_buckets, construct_s: float,
                       wait_for_compiles=lambda: None) -> None:
    """Dynamo and Inductor: the compiled forward's first run, under the compile cache; records
    their timings (construct_s: making `forward`, which imports Dynamo). wait_for_compiles: the
    background kernel compiles' finish, called before the cache entry is signed: those begun while
    the entry was active write Triton's cache into it, and a file written during the signing could
    be signed half-made or vanish under it (the entry then rebuilt, or deleted as unsaved)."""
    config, timings = runner.config, runner.timings
    t0 = time.perf_counter()
    cache, cache_ctx = _open_cache(runner, buckets, decode_buckets)
    # Everything from here to the close runs inside the try: the entry's lock, held since open(),
    # is released whatever stops the start (a Ctrl-C, an error), or the next start waits on it.
    try:
        if cache is not None and saved_trace.enabled():
            # A hit loads the trace an earlier start saved into the entry for this KV-cache shape;
            # else this start saves one (compile/saved_trace.py).
            path = cache.entry / saved_trace.file_name(runner.num_kv_blocks, runner.block_size)
            forward.saved_trace = (str(path), "load" if cache.state == "hit" and path.exists() else "save")
        before = inductor_cache_counters()
        try:
            with cache_ctx:
                # Trace and compile at the largest size the runner will graph (Inductor's size hint).
                trace_tokens = max(buckets[-1] if buckets else min(config.max_capture_tokens,
                                                                   config.max_num_batched_tokens), MIN_TRACED_TOKENS)
                _dummy_forward(runner, forward, trace_tokens)
        except Exception as e:
            if cache is None or not _out_of_space(e, cache.entry):
                raise
            # Inductor's own writes into the entry failed (an OSError inside its errors, or a C++
            # compiler that could not write its output): a traceback from deep in Inductor, and the
            # next start deleted the half-built entry, compiled again and failed again.
            cache.abandon()
            raise CompileCacheError(f"no space left on the device of {cache.root} while compiling into it "
                                    f"({type(e).__name__}); free space there, choose another directory (or "
                                    "compile_cache=False)") from e
        w0 = time.perf_counter()
        wait_for_compiles()
        waited_s = time.perf_counter() - w0      # the pre-compile's wait, timed there (not Dynamo's)
        if cache is not None:
            try:
                cache.commit(written=[forward.saved_trace_written] if forward.saved_trace_written else [])
            except OSError as e:
                # The compiled forward is in memory: this start goes on.
                cache.abandon()
                warnings.warn(f"compile cache entry {cache.entry} not saved ({e.strerror or e}); the next start "
                              "compiles again")
                timings["compile_cache_unsaved"] = 1.0
    finally:
        if cache is not None:
            cache.close()
    compile_s = construct_s + time.perf_counter() - t0 - waited_s
    after = inductor_cache_counters()
    stats = forward.stats
    timings["inductor_s"] = stats.inductor_s
    # Everything of the compile phase but Inductor: Dynamo's import and trace, the split, the
    # compile cache's checks.
    timings["dynamo_s"] = max(compile_s - stats.inductor_s, 0.0)
    timings["dynamo_traces"] = float(stats.dynamo_traces)
    timings["inductor_compiles"] = float(stats.inductor_compiles)
    timings["compiled_pieces"] = float(stats.pieces)
    timings["inductor_cache_hits"] = float(after["hit"] - before["hit"])
    timings["inductor_cache_misses"] = float(after["miss"] - before["miss"])
    timings["saved_trace_loaded"] = 1.0 if forward.saved_trace_loaded else 0.0
    if forward.saved_trace_error:
        runner.saved_trace_error = forward.saved_trace_error


@torch.inference_mode()
def setup_compiled_modes(runner, progress=None) -> None:
    mode, config, timings = runner.mode, runner.config, runner.timings
    cuda = runner.device.type == "cuda"
    pool = GraphPool(runner.device)
    runner.graph_pool = pool
    buckets = token_buckets_for(runner) if mode in PIECEWISE_MODES else []
    decode_buckets = None
    if mode in FULL_MODES:
        decode_buckets = config.decode_buckets or default_decode_buckets(min(config.max_num_seqs,
                                                                                 config.max_num_batched_tokens))

    if mode in COMPILED_MODES:
        split = mode != "compile"
        t0 = time.perf_counter()     # from here: importing Dynamo (no earlier step of the start-up does)
        forward = CompiledForward(runner.model, split=split, graphs=pool if split else None, buckets=buckets)
        runner.forward_fn = forward
        runner.token_buckets = buckets if split else []      # 'compile': every T runs unpadded
        construct_s = time.perf_counter() - t0
    else:
        runner.token_buckets = []
    if mode in FULL_MODES:
        runner.full_graphs = FullDecodeGraphs(runner, decode_buckets, pool=pool)   # captured below
    # Every Triton variant that capture and warm-up will launch, compiled in threads while Dynamo
    # and Inductor work (engine/precompile.py; None where there is nothing to compile).
    compiles = precompile.start(runner, buckets)
    waited = []

    def wait_for_compiles():
        if not waited:
            waited.append(True)
            precompile.finish(runner, compiles)

    try:
        if mode in COMPILED_MODES:
            _trace_and_compile(runner, forward, buckets, decode_buckets, construct_s, wait_for_compiles)
    finally:
        wait_for_compiles()     # also when the compile fails: no thread or hook left behind

    reserved0 = torch.cuda.memory_reserved(runner.device) if cuda else 0
    if cuda and buckets:                # piecewise modes
        timings["capture_s"] = capture_piecewise(runner, runner.forward_fn, buckets, progress)
    if mode in FULL_MODES:
        timings["capture_s"] = timings.get("capture_s", 0.0) + runner.full_graphs.capture_all(progress)

    if cuda:
        timings["graph_pool_mib"] = (torch.cuda.memory_reserved(runner.device) - reserved0) / 2**20


__all__ = ["setup_compiled_modes", "token_buckets_for", "capture_piecewise"]
