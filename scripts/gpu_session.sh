#!/usr/bin/env bash
# GPU measurements and gpu-marked tests, by part; one device call runs several parts in order, each
# under its own timeout so that the whole call stays inside the device's 10-minute limit.
#   bash scripts/gpu_session.sh graphs p1 tests     # parts run in the order given
# On a two-GPU machine two lists can run side by side, each on its own GPU, models and caches:
#   CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a bash scripts/gpu_session.sh ... & \
#   CUDA_VISIBLE_DEVICES=1 OUT=$OUT/b M=/tmp/mb HOME=/tmp/hb TORCHINDUCTOR_CACHE_DIR=/tmp/ib bash scripts/gpu_session.sh ...
# Parts: graphs (gpu tests of tests/compile), tests (every other gpu test: ~155 tests, ~5 min on one H200;
# at most 400 s here, TESTS= narrows it), p1 (latency, 0.6B, all
# modes), p5 (start-up), p5notrace (p5 with PCG_SAVED_TRACE=0), p5warm2 (p5 with PCG_FULL_GRAPH_WARMUPS=2), p5warmfirst (p5 with PCG_FULL_GRAPH_WARMUP_EVERY=0), p5ab (P5AB=VAR=A,B: one cold start, then warm starts
# with VAR=A, B, A, B on its caches), p5off (p5 with PCG_PRECOMPILE=0), precompile (its gpu tests and the warm-up's), load8b (weight load of 8B), p1_8b, p1_8b_graphs (8B's two graph modes; P1_8B_MODES), prof1_8b (8B batch-1 kernel table, PCG_PDL=PROF_PDL, default 0; PROF1_8B_CONFIGS, PROF1_8B_ARGS, PROF1_8B_LIM s), p2, p3, p3rates (P3 at higher rates),
# probeproc (bench/cpu_probe.py in PROBE_PROCS fresh processes), coreprobe (scripts/core_probe.py: the probe on each core, three processes), corepin (P1 on coreprobe's fastest and slowest core), ttft (issue 5's 1/8/32 x 512), ttfttree (ttft at TTFT_N prompts, this tree against AB_TREE, alternated twice; TTFT_MODES), p1_noskinny (p1's graph modes with PCG_SKINNY_GEMM=0), p1_nopdl / p1_8b_nopdl (graph modes with PCG_PDL=0),
# p1_nofast (piecewise modes with PCG_FAST_LAUNCH=0), fastlaunch (its gpu tests + scripts/bench_attention_launch.py),
# p1_moe (P1 every mode on Qwen3-30B-A3B's first MOE_LAYERS layers, default 8: make-model --num-layers; the whole
# checkpoint, 61 GB, does not fit the machine's disk), rawab (bench_attention_launch.py --raw-ab: the launcher object against Triton 3.6's C launch, per call and bound; RAWAB_CONFIGS),
# p1_norope (graph modes with PCG_FUSED_ROPE_ATTENTION=0), p1_piece (piecewise: Inductor pieces vs FX pieces; alternated twice), p1_trace (piecewise P1, PCG_SAVED_TRACE=0/1 alternated twice),
# prof1 (batch-1 profile with each config's kernels by name; PROF1_CONFIGS, PROF1_TAG, PROF_MODEL: a preset, PRESET:N its first N layers), fusedrope (its tests on the GPU + bench_kernels --only rope_attention),
# p1 takes P1_MODES and P1_TAG; overhead32 takes OVERHEAD_LIM (s per size); p4 (host overhead), overhead (the overhead table), overhead32 (the same in float32: its same_tokens), profile, kernels, hostprof (scripts/host_profile.py
# per mode of HOSTPROF_MODES at HOSTPROF_N requests), skinny (the skinny-GEMM tile sweep), blas (F.linear under cuBLAS vs cuBLASLt; BLAS_ARGS),
# fwdhost (scripts/forward_host.py: an eager full-decode forward's host ms and its Triton JIT share), p1_rope / p1_8b_rope
# (P1 full_decode, PCG_FUSED_ROPE_ATTENTION=0/1 alternated twice; ROPE_MODES), p1ab (P1 with AB_VAR=each of AB_VALUES,
# alternated twice; AB_MODEL, P1_MODES), p2ab (P2 with AB_VAR=each of AB_VALUES, alternated twice),
# p1tree (P1 of this tree against the base tree in AB_TREE, alternated twice; TREE_VALUES like "base new:VAR=x new"),
# hostinfo (lscpu, NUMA, governor), p1pin (P1 as is / under taskset -c N / with MALLOC_ARENA_MAX=1 / with huge pages for the Python heap: PIN_VALUES off, tasksetN, arena1, thp, alternated twice; P1_MODES),
# drift (scripts/host_drift.py with PCG_FULL_GRAPH_WARMUP_EVERY=each of DRIFT_VALUES; DRIFT_MODE, DRIFT_WINDOWS),
# capture (scripts/bench_capture.py: a graph capture's host cost by phase; CAPTURE_ARGS), capture_engine (its --engine run), p5prof (p5 with cProfile text per run),
# splitk (scripts/bench_split_k_norm.py: 8B's o/down + norm, cuBLAS vs kernels/split_k.py and its variants; then test_split_k.py's gpu tests),
# p1solo (P1 of each of SOLO_MODES in its own process, alternated SOLO_ROUNDS times, then SOLO_PAIR in one process; AB_MODEL, default 8B),
# secondprobe (scripts/second_engine_probe.py per variant of PROBE_VARIANTS: plain, --keep-cache, --clear-cublas, expandable, VAR=value; PROBE_MODES, AB_MODEL),
# b1probe (scripts/attention_b1_probe.py: B1 x 8192 decode attention's parts against a copy and a read of its bytes; B1_CONTEXTS=8192,32768: the attention and a copy at each context instead; B1_LAYOUTS=1: token- against head-major KV cache at block sizes 16 / 64 / 128; B1_DIAG=1: other tunings against a paged read of the same bytes),
# l2bench (scripts/bench_l2_prefetch.py: 8B's batch-1 layer stand-in with and without L2 prefetches of the next weight).
# p4tree (P4 of this tree against the base tree in AB_TREE, alternated TREE_ROUNDS times, default 3).
# The tree parts (p1tree, ttfttree, p4tree) run Python with PYTHONSAFEPATH=1: `python3 -m` puts the working
# directory (this tree) first on sys.path, ahead of PYTHONPATH, so without it every "base" run ran this tree
# (sessions 14-16's tree A/Bs did; docs/PERF.md, session 23).
# Set PCG_COMMIT to the commit being measured (the device copy carries no .git).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PCG_COMMIT=${PCG_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B="python3 -m pcg_engine.cli bench"
T="python3 -m pytest -v -rfE -p no:cacheprovider --timeout 150 -m gpu"  # -v: a killed run still names what ran
M=${M:-/tmp/models}; mkdir -p $M
model() {  # build a preset once on the GPU (random weights at the published shapes); PRESET:N = its first N layers
  local p=${1%%:*} n=; [ "$p" != "$1" ] && n=${1#*:}
  local d=$M/$p${n:+-${n}l}
  [ -f $d/config.json ] || python3 -m pcg_engine.cli make-model --preset $p ${n:+--num-layers $n} --out $d --device cuda \
    --overwrite >/dev/null || return 1
  echo $d
}
DEADLINE=${DEADLINE:-570}   # seconds: the device call's limit is 600
lim() { local left=$((DEADLINE - SECONDS)); echo $(( $1 < left ? $1 : (left > 1 ? left : 1) )); }
part() {
  case "$1" in
    graphs) timeout $(lim 250) $T tests/compile ${GRAPHS_K:+-k "$GRAPHS_K"} 2>&1 | tee $OUT/gpu_graphs.log | tail -25 ;;
    tests) timeout $(lim 400) $T ${TESTS:-tests --ignore=tests/compile} 2>&1 | tee $OUT/gpu_tests.log | tail -25 ;;
    p1) timeout $(lim 180) $B latency --model $(model qwen3-0.6b) --modes ${P1_MODES:-eager,full_decode,piecewise,full_and_piecewise} \
          --num-iters 2 --warmup-iters 1 --json $OUT/p1_q06${P1_TAG:-}.json 2>&1 | tail -12 ;;
    drift) for v in ${DRIFT_VALUES:-0 1}; do   # batch-1 TPOT and each thread's CPU in the seconds after ready (scripts/host_drift.py)
            PCG_FULL_GRAPH_WARMUP_EVERY=$v timeout $(lim 120) python3 scripts/host_drift.py --model $(model qwen3-0.6b) \
              --mode ${DRIFT_MODE:-full_decode} --windows ${DRIFT_WINDOWS:-40} --json $OUT/drift_${DRIFT_MODE:-full_decode}_every$v.json 2>&1 \
              | grep -E "^window" | sed "s/^/every=$v /"
          done ;;
    p1_noskinny) PCG_SKINNY_GEMM=0 timeout $(lim 120) $B latency --model $(model qwen3-0.6b) --modes full_decode,full_and_piecewise \
          --num-iters 2 --warmup-iters 1 --json $OUT/p1_q06_noskinny.json 2>&1 | tail -7 ;;   # the A/B of the skinny GEMM
    p5) timeout $(lim 200) $B startup --model $(model qwen3-0.6b) --mode full_and_piecewise --json $OUT/p5_q06.json ${P5_ARGS:-} 2>&1 | tail -9 ;;
    p5notrace) PCG_SAVED_TRACE=0 timeout $(lim 200) $B startup --model $(model qwen3-0.6b) --mode full_and_piecewise \
          --json $OUT/p5_q06_notrace.json ${P5_ARGS:-} 2>&1 | tail -9 ;;   # A/B: compile/saved_trace.py
    p5warm2) PCG_FULL_GRAPH_WARMUPS=2 timeout $(lim 200) $B startup --model $(model qwen3-0.6b) --mode full_and_piecewise \
          --json $OUT/p5_q06_warm2.json ${P5_ARGS:-} 2>&1 | tail -9 ;;   # A/B: two warm-ups a full decode graph (compile/full_graph.py)
    p5warmfirst) PCG_FULL_GRAPH_WARMUP_EVERY=0 timeout $(lim 200) $B startup --model $(model qwen3-0.6b) --mode full_and_piecewise \
          --json $OUT/p5_q06_warmfirst.json ${P5_ARGS:-} 2>&1 | tail -9 ;;   # A/B: a warm-up before the largest full decode bucket only (compile/full_graph.py)
    p5ab) timeout $(lim 240) $B startup --model $(model qwen3-0.6b) --mode full_and_piecewise --warm-ab ${P5AB:?P5AB=VAR=A,B} \
          --no-cold-bytecode --json $OUT/p5ab.json 2>&1 | tail -14 ;;   # one cold start, then warm starts alternated over the switch
    p5off) PCG_PRECOMPILE=0 timeout $(lim 200) $B startup --model $(model qwen3-0.6b) --mode full_and_piecewise \
          --json $OUT/p5_q06_noprecompile.json ${P5_ARGS:-} 2>&1 | tail -8 ;;   # A/B: engine/precompile.py
    p5workers) for w in ${P5_WORKERS:-4 8}; do   # the pre-compile's thread count (engine/precompile.py)
            PCG_PRECOMPILE_WORKERS=$w timeout $(lim 120) $B startup --model $(model qwen3-0.6b) --mode full_and_piecewise \
              --json $OUT/p5_q06_workers$w.json 2>&1 | grep -E "cold|warm" | sed "s/^/workers $w /"
          done ;;
    precompile) timeout $(lim 240) $T tests/engine/test_precompile.py tests/engine/test_warmup.py 2>&1 | tee $OUT/gpu_precompile.log | tail -15 ;;
    load8b) timeout $(lim 90) $B load --model $(model qwen3-8b) --device cuda --json $OUT/load_q8b.json 2>&1 | tail -14 ;;
    p1_8b) timeout $(lim 240) $B latency --model $(model qwen3-8b) --modes eager,full_decode,piecewise,full_and_piecewise --num-iters 2 \
          --warmup-iters 1 --json $OUT/p1_q8b.json 2>&1 | tail -8 ;;
    p1_8b_graphs) timeout $(lim 200) $B latency --model $(model qwen3-8b) --modes ${P1_8B_MODES:-full_decode,full_and_piecewise} --num-iters 2 \
          --warmup-iters 1 --json $OUT/p1_q8b_graphs.json 2>&1 | tail -6 ;;
    prof1_8b) PCG_PDL=${PROF_PDL:-0} timeout $(lim ${PROF1_8B_LIM:-150}) $B profile --model $(model qwen3-8b) --requests 1 --steps 20 --kernel-table \
          --configs "${PROF1_8B_CONFIGS:-full graphs + async}" ${PROF1_8B_ARGS:-} --out-dir $OUT/prof1_8b --json $OUT/prof1_8b.json 2>&1 | tail -${PROF1_TAIL:-60} ;;
    p1_nopdl) PCG_PDL=0 timeout $(lim 120) $B latency --model $(model qwen3-0.6b) --modes full_decode,full_and_piecewise \
          --num-iters 2 --warmup-iters 1 --json $OUT/p1_q06_nopdl.json 2>&1 | tail -7 ;;   # A/B: kernels/pdl.py
    p1_piece) for i in 1 2; do for v in inductor eager; do   # A/B, alternated: Inductor vs FX pieces (compile/backend.py)
            PCG_PIECE_COMPILER=$v timeout $(lim 100) \
              $B latency --model $(model qwen3-0.6b) --modes ${P1_MODES:-piecewise} --num-iters 2 --warmup-iters 1 \
              --json $OUT/p1_q06_piece_$v-$i.json 2>&1 | grep -E "piecewise|mode" | sed "s/^/$v /"
          done; done ;;
    p1_trace) for i in 1 2; do for v in 0 1; do   # A/B, alternated: piecewise P1 without / with the saved trace (compile/saved_trace.py)
            PCG_SAVED_TRACE=$v timeout $(lim 100) \
              $B latency --model $(model qwen3-0.6b) --modes ${P1_MODES:-piecewise} --num-iters 2 --warmup-iters 1 \
              --json $OUT/p1_q06_trace$v-$i.json 2>&1 | grep -E "piecewise|mode" | sed "s/^/trace=$v /"
          done; done ;;
    prof1) timeout $(lim 120) $B profile --model $(model ${PROF_MODEL:-qwen3-0.6b}) --requests 1 --steps 20 --kernel-table \
          --configs "${PROF1_CONFIGS:-full graphs + async,piecewise + async}" --out-dir $OUT/prof1${PROF1_TAG:-} \
          --json $OUT/prof1${PROF1_TAG:-}.json 2>&1 | tail -${PROF1_TAIL:-90} ;;
    p1_nofast) PCG_FAST_LAUNCH=0 timeout $(lim 120) $B latency --model $(model qwen3-0.6b) --modes ${P1_MODES:-piecewise,full_and_piecewise} \
          --num-iters 2 --warmup-iters 1 --json $OUT/p1_q06_nofast.json 2>&1 | tail -7 ;;   # A/B: kernels/fast_launch.py
    p1_norope) PCG_FUSED_ROPE_ATTENTION=0 timeout $(lim 120) $B latency --model $(model qwen3-0.6b) --modes ${P1_MODES:-full_decode,full_and_piecewise} \
          --num-iters 2 --warmup-iters 1 --json $OUT/p1_q06_norope.json 2>&1 | tail -7 ;;   # A/B: attention/rope_decode_attention.py
    fusedrope) timeout $(lim 200) ${T% -m gpu} tests/kernels/test_rope_decode_attention.py tests/kernels/test_rope_decode_backend.py 2>&1 | tee $OUT/gpu_fusedrope.log | tail -15
          timeout $(lim 150) python3 scripts/bench_kernels.py --only rope_attention --json $OUT/rope_attention.json 2>&1 | tail -22 ;;
    fastlaunch) timeout $(lim 150) ${T% -m gpu} tests/kernels/test_fast_launch_gpu.py tests/kernels/test_fast_launch.py 2>&1 | tee $OUT/gpu_fastlaunch.log | tail -15
          timeout $(lim 120) python3 scripts/bench_attention_launch.py --json $OUT/attention_launch.json 2>&1 | tail -20 ;;
    rawab) timeout $(lim 150) python3 scripts/bench_attention_launch.py --raw-ab --paths kernel,bound \
          --configs ${RAWAB_CONFIGS:-decode_b1_ctx256,decode_b1_ctx2048} --json $OUT/attention_launch_rawab.json 2>&1 | tail -30 ;;
    p1_moe) L=${MOE_LAYERS:-8}; d=$(model qwen3-30b-a3b:$L)   # Qwen3-30B-A3B's first L layers at the published shapes
          timeout $(lim 360) $B latency --model $d --modes ${P1_MODES:-eager,full_decode,piecewise,full_and_piecewise} \
            --num-iters 2 --warmup-iters 1 --json $OUT/p1_moe${L}l.json 2>&1 | tail -12 ;;
    p1_8b_nopdl) PCG_PDL=0 timeout $(lim 180) $B latency --model $(model qwen3-8b) --modes full_decode,full_and_piecewise \
          --num-iters 2 --warmup-iters 1 --json $OUT/p1_q8b_nopdl.json 2>&1 | tail -7 ;;
    p2) timeout $(lim 150) $B throughput --model $(model qwen3-0.6b) --modes full_and_piecewise --json $OUT/p2_q06${P2_TAG:-}.json 2>&1 | tail -8 ;;
    p2ab) for i in 1 2; do for v in ${AB_VALUES:-0 1}; do   # A/B, alternated twice: P2 with env AB_VAR=v
            env ${AB_VAR:?AB_VAR names the switch}=$v timeout $(lim 150) $B throughput --model $(model qwen3-0.6b) \
              --modes full_and_piecewise --json $OUT/p2ab_${AB_VAR}_$v-$i.json 2>&1 | grep -E "full_and_piecewise|mode" | sed "s/^/$AB_VAR=$v run $i /"
          done; done ;;
    p3) timeout $(lim 200) $B load-test --model $(model qwen3-0.6b) --modes full_decode,full_and_piecewise --num-prompts 300 \
          --request-rate 20 --input-len 1024 --output-len 128 --goodput ttft:200 tpot:20 --no-progress \
          --json $OUT/p3_q06.json 2>&1 | tail -12 ;;
    p3rates) for r in ${P3_RATES:-30 40 50}; do   # P3's overload point: where full_decode's p99 TTFT passes 500 ms
            timeout $(lim 120) $B load-test --model $(model qwen3-0.6b) --modes full_decode,full_and_piecewise \
              --num-prompts 300 --request-rate $r --input-len 1024 --output-len 128 --goodput ttft:200 tpot:20 \
              --no-progress --json $OUT/p3_rate$r.json 2>&1 | grep -E "ttft p99|goodput|mode"
          done ;;
    ttft) for n in 1 8 32; do   # issue 5's P3: TTFT of n concurrent 512-token prompts
            timeout $(lim 60) $B load-test --model $(model qwen3-0.6b) --modes full_decode,full_and_piecewise --num-prompts $n \
              --request-rate inf --input-len 512 --output-len 2 --range-ratio 0 --no-progress \
              --json $OUT/ttft_512x$n.json 2>&1 | tail -6
          done ;;
    ttfttree) for i in $(seq ${TREE_ROUNDS:-2}); do for v in ${TREE_VALUES:-base new}; do   # A/B, alternated: ttft's load-test
            # at TTFT_N prompts (default 8) of this tree ("new") against the tree unpacked in AB_TREE ("base"), as p1tree;
            # any other name X is the tree in abtree/X (a bisection: git archive <commit> pcg_engine into abtree/X)
            tree=${v%%:*}; envs=; [ "$tree" != "$v" ] && envs=${v#*:}
            case $tree in new) pp=$PWD ;; base) pp=$PWD/${AB_TREE:?AB_TREE: the base tree} ;; *) pp=$PWD/abtree/$tree ;; esac
            env PYTHONSAFEPATH=1 PYTHONPATH=$pp $envs timeout $(lim 150) $B load-test --model $(model qwen3-0.6b) --modes ${TTFT_MODES:-full_decode,full_and_piecewise} \
              --num-prompts ${TTFT_N:-8} --request-rate inf --input-len 512 --output-len 2 --range-ratio 0 --no-progress \
              --json $OUT/ttfttree_${v//[:=]/_}-$i.json 2>&1 | grep -iE "ttft|mode|fixed host" | sed "s/^/$v run $i /"
          done; done ;;
    probeproc) for i in $(seq ${PROBE_PROCS:-20}); do   # bench/cpu_probe.py in fresh bare processes (no engine, no GPU)
            timeout $(lim 30) python3 -c "import json; from pcg_engine.bench import cpu_probe; print(json.dumps(cpu_probe.probe()))"
          done > $OUT/probeproc.jsonl; python3 -c "import json,sys; r=[json.loads(l) for l in open('$OUT/probeproc.jsonl')]
for k in ('python_median_us', 'torch_median_us'): v=sorted(x[k] for x in r); print(k, len(v), 'min %.0f median %.0f max %.0f' % (v[0], v[len(v)//2], v[-1]))" ;;
    coreprobe) for i in 1 2 3; do   # scripts/core_probe.py in three processes, 5 s apart: is the slow speed a core's?
            timeout $(lim 60) python3 scripts/core_probe.py --json $OUT/cores_$i.json 2>&1 | sed "s/^/probe $i /"; sleep 5
          done ;;
    corepin) # P1 (P1_MODES, default piecewise) under taskset on the fastest and the slowest core of coreprobe's last
          # process by its median Python probe, alternated twice (run coreprobe first)
          read fast slow < <(python3 -c "import json; d=json.load(open('$OUT/cores_3.json'))['cores']
m = {c: sorted(r['python_median_us'] for r in runs)[len(runs) // 2] for c, runs in d.items()}; s = sorted(m, key=m.get); print(s[0], s[-1])")
          echo "fastest core $fast, slowest core $slow"
          for i in 1 2; do for c in $fast $slow; do
            taskset -c $c timeout $(lim 120) $B latency --model $(model ${AB_MODEL:-qwen3-0.6b}) --modes ${P1_MODES:-piecewise} \
              --num-iters 2 --warmup-iters 1 --json $OUT/corepin_$c-$i.json 2>&1 | grep -E "│|the OS|fixed host" | sed "s/^/core=$c run $i /"
          done; done ;;
    p4) timeout $(lim 60) $B overhead --host-only --model $(model qwen3-0.6b) --batch-sizes 16,64,256 --json $OUT/p4_host.json 2>&1 | tail -8 ;;
    overhead) for n in ${OVERHEAD_N:-16 64 256}; do
            timeout $(lim 150) $B overhead --model $(model qwen3-0.6b) --requests $n --slots $n --new-tokens 64 \
              --json $OUT/overhead$n.json 2>&1 | tail -12
          done ;;
    overhead32) for n in ${OVERHEAD_N:-16 64 256}; do   # same_tokens in float32 (see pcg_engine/bench/overhead.py)
            timeout $(lim ${OVERHEAD_LIM:-150}) $B overhead --model $(model qwen3-0.6b) --requests $n --slots $n --new-tokens 64 --dtype float32 \
              --json $OUT/overhead32_$n.json 2>&1 | tail -12
          done ;;
    profile) timeout $(lim 120) $B profile --model $(model qwen3-0.6b) --requests 256 --configs 'full graphs,full graphs + async' --out-dir $OUT/profile 2>&1 | tail -12 ;;
    hostprof) for mo in ${HOSTPROF_MODES:-piecewise full_decode}; do   # cProfile + kernel list of batch-1 decode
            timeout $(lim 120) python3 scripts/host_profile.py --model $(model qwen3-0.6b) --mode $mo --requests ${HOSTPROF_N:-1} \
              --steps ${HOSTPROF_STEPS:-50} ${HOSTPROF_ARGS:-} > $OUT/hostprof_${mo}_${HOSTPROF_N:-1}${HOSTPROF_TAG:-}.txt 2>&1; grep -A12 "===" $OUT/hostprof_${mo}_${HOSTPROF_N:-1}${HOSTPROF_TAG:-}.txt | head -40
          done ;;
    blas) timeout $(lim 150) python3 scripts/bench_blas.py ${BLAS_ARGS:-} --json $OUT/blas.json 2>&1 | tail -45 ;;
    splitk) timeout $(lim 120) python3 scripts/bench_split_k_norm.py --json $OUT/split_k_norm.json 2>&1 | tail -20   # the o/down + norm pair
          timeout $(lim 150) $T tests/kernels/test_split_k.py 2>&1 | tee $OUT/gpu_split_k.log | tail -6 ;;   # its gpu-marked tests
    l2bench) timeout $(lim 150) python3 scripts/bench_l2_prefetch.py --json $OUT/l2_prefetch.json 2>&1 | grep -v Warn | tail -16 ;;
    b1probe) timeout $(lim 150) python3 scripts/attention_b1_probe.py ${B1_CONTEXTS:+--contexts $B1_CONTEXTS} ${B1_LAYOUTS:+--layouts} ${B1_DIAG:+--diag} --json $OUT/attention_b1_probe.json 2>&1 | grep -v Warn | tail -20 ;;
    skinny) timeout $(lim 300) python3 scripts/bench_skinny_gemm.py ${SKINNY_ARGS:-} --json $OUT/skinny.json 2>&1 | tail -60 ;;
    capture) timeout $(lim 120) python3 scripts/bench_capture.py ${CAPTURE_ARGS:-} --json $OUT/capture.json 2>&1 | tail -12 ;;
    capture_engine) timeout $(lim 200) python3 scripts/bench_capture.py --engine $(model qwen3-0.6b) --json $OUT/capture_engine.json 2>&1 | tail -14 ;;
    fwdhost) timeout $(lim 150) python3 scripts/forward_host.py --model $(model qwen3-0.6b) --json $OUT/forward_host.json ${FWD_ARGS:-} > $OUT/forward_host.txt 2>&1; head -8 $OUT/forward_host.txt ;;
    p1_rope|p1_8b_rope) for i in 1 2; do for v in 0 1; do   # A/B, alternated: PCG_FUSED_ROPE_ATTENTION (attention/triton_backend.py)
            m=qwen3-0.6b; [ "$1" = p1_8b_rope ] && m=qwen3-8b
            PCG_FUSED_ROPE_ATTENTION=$v timeout $(lim 120) $B latency --model $(model $m) --modes ${ROPE_MODES:-full_decode} \
              --num-iters 2 --warmup-iters 1 --json $OUT/$1_$v-$i.json 2>&1 | grep -E "full_decode|piecewise|mode" | sed "s/^/rope=$v run $i /"
          done; done ;;
    p1ab) for i in 1 2; do for v in ${AB_VALUES:-0 1}; do   # A/B, alternated twice: P1 (AB_MODEL, P1_MODES) with env AB_VAR=v
            env ${AB_VAR:?AB_VAR names the switch}=$v timeout $(lim 120) $B latency --model $(model ${AB_MODEL:-qwen3-0.6b}) \
              --modes ${P1_MODES:-full_decode} --num-iters 2 --warmup-iters 1 --json $OUT/p1ab_${AB_VAR}_$v-$i.json 2>&1 \
              | grep -E "full_decode|piecewise|mode|the OS|fixed host" | sed "s/^/$AB_VAR=$v run $i /"
          done; done ;;
    p1solo) # each mode of SOLO_MODES in its own process, alternated SOLO_ROUNDS times (a process's second engine read
          # slower than its first in session 19); then SOLO_PAIR (e.g. full_decode,full_decode) in one process; clocks logged
          nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv -lms 500 > $OUT/smi_p1solo.csv 2>&1 &
          SMI=$!
          for i in $(seq ${SOLO_ROUNDS:-2}); do for m in ${SOLO_MODES:-full_and_piecewise full_decode}; do
            timeout $(lim 120) $B latency --model $(model ${AB_MODEL:-qwen3-8b}) --modes $m --num-iters 2 --warmup-iters 1 \
              --json $OUT/p1solo_${m}-$i.json 2>&1 | grep -E "^│ (full|piece|eager)" | sed "s/^/solo run $i /"
          done; done
          [ -n "${SOLO_PAIR:-}" ] && timeout $(lim 200) $B latency --model $(model ${AB_MODEL:-qwen3-8b}) --modes $SOLO_PAIR --num-iters 2 \
              --warmup-iters 1 --json $OUT/p1solo_pair.json 2>&1 | grep -E "^│ (full|piece|eager)" | sed "s/^/pair /"
          kill $SMI ;;
    secondprobe) for v in ${PROBE_VARIANTS:-plain}; do   # scripts/second_engine_probe.py: engines one after another in one process
            # a variant: plain, a flag of the script (--keep-cache, --clear-cublas), or expandable (the allocator's expandable segments)
            # or VAR=value (an environment switch, e.g. PCG_FAST_LAUNCH=0)
            case $v in plain) a="" e="" ;; expandable) a="" e="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" ;; *=*) a="" e=$v ;; *) a=$v e="" ;; esac
            env $e timeout $(lim 150) python3 scripts/second_engine_probe.py --model $(model ${AB_MODEL:-qwen3-8b}) \
              --modes ${PROBE_MODES:-full_decode,full_decode} $a --json $OUT/second_engine_$v.json 2>&1 | grep '^{' | sed "s/^/$v /"
          done ;;
    p1tree) for i in 1 2; do for v in ${TREE_VALUES:-base new}; do   # A/B, alternated twice: P1 of this tree ("new") against
            # the tree unpacked in AB_TREE ("base", e.g. git archive of the commit before a change); "new:VAR=x" adds a switch
            # (any other name X: the tree in abtree/X, as ttfttree)
            tree=${v%%:*}; envs=; [ "$tree" != "$v" ] && envs=${v#*:}
            case $tree in new) pp=$PWD ;; base) pp=$PWD/${AB_TREE:?AB_TREE: the base tree} ;; *) pp=$PWD/abtree/$tree ;; esac
            env PYTHONSAFEPATH=1 PYTHONPATH=$pp $envs timeout $(lim 120) python3 -m pcg_engine.cli bench latency --model $(model ${AB_MODEL:-qwen3-0.6b}) \
              --modes ${P1_MODES:-full_decode} --num-iters 2 --warmup-iters 1 --json $OUT/p1tree_${v//[:=]/_}-$i.json 2>&1 \
              | grep -E "full_decode|piecewise|mode" | sed "s/^/$v run $i /"
          done; done ;;
    p4tree) for i in $(seq ${TREE_ROUNDS:-3}); do for v in ${TREE_VALUES:-base new}; do   # A/B, alternated: P4 (p4's
            # command) of this tree ("new") against the tree unpacked in AB_TREE ("base"), as p1tree
            tree=${v%%:*}; envs=; [ "$tree" != "$v" ] && envs=${v#*:}
            [ $tree = base ] && pp=$PWD/${AB_TREE:?AB_TREE: the base tree} || pp=$PWD
            env PYTHONSAFEPATH=1 PYTHONPATH=$pp $envs timeout $(lim 90) $B overhead --host-only --model $(model qwen3-0.6b) \
              --batch-sizes 16,64,256 --json $OUT/p4tree_${v//[:=]/_}-$i.json 2>&1 | grep -E "│ (16|64|256) |at 256: fixed" \
              | sed "s/^/$v run $i /"
          done; done ;;
    hostinfo) { nproc; env | grep -iE "malloc|preload|omp_|mkl"; python3 -c "import torch; print(open('/proc/self/maps').read())" | grep -iE "jemalloc|tcmalloc|mimalloc" | head -3; lscpu; numactl -H 2>&1 | head -5; grep . /sys/kernel/mm/transparent_hugepage/{enabled,defrag} 2>&1; grep -m3 MHz /proc/cpuinfo; head -1 /proc/stat
          cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>&1; } > $OUT/hostinfo.txt 2>&1; head -30 $OUT/hostinfo.txt ;;
    p1pin) for i in 1 2; do for v in ${PIN_VALUES:-off taskset2}; do   # A/B, alternated twice: P1 (P1_MODES) as is (off),
            # with the whole process under taskset -c N (tasksetN), with glibc's MALLOC_ARENA_MAX=1 (arena1), or thp
            pin=
            # thp: every Python allocation through glibc malloc, which madvises transparent huge pages
            # (glibc >= 2.35; THP "madvise" leaves pymalloc's arenas on 4 KiB pages otherwise)
            case $v in taskset*) pin="taskset -c ${v#taskset}" ;; arena1) pin="env MALLOC_ARENA_MAX=1" ;;
              thp) pin="env PYTHONMALLOC=malloc GLIBC_TUNABLES=glibc.malloc.hugetlb=1" ;; esac
            $pin timeout $(lim 120) $B latency --model $(model ${AB_MODEL:-qwen3-0.6b}) --modes ${P1_MODES:-full_decode,piecewise} \
              --num-iters 2 --warmup-iters 1 --json $OUT/p1pin_$v-$i.json 2>&1 | grep -E "full_decode|piecewise|mode|the OS|fixed host" | sed "s/^/pin=$v run $i /"
          done; done ;;
    warmcheck) for v in 0 1; do   # scripts/graph_warmup_check.py with PCG_FULL_GRAPH_WARMUP_EVERY=0, then 1
            PCG_FULL_GRAPH_WARMUP_EVERY=$v timeout $(lim 120) python3 scripts/graph_warmup_check.py --model $(model qwen3-0.6b) \
              --out $OUT/warmcheck$v 2>&1 | tail -40
          done ;;
    p5prof) timeout $(lim 240) $B startup --model $(model qwen3-0.6b) --mode full_and_piecewise --json $OUT/p5_q06_prof.json \
          --profile-dir $OUT/p5prof 2>&1 | tail -9 ;;   # p5 with a cProfile of each run (cold.txt, warm.txt, ...)
    kernels) timeout $(lim 150) python3 scripts/bench_kernels.py ${KERNELS_ARGS:-} --json $OUT/kernels.json 2>&1 | tail -30 ;;
    *) echo "unknown part: $1"; exit 2 ;;
  esac
}
for p in "${@:-graphs}"; do
  if (( DEADLINE - SECONDS < 30 )); then echo "=== $p skipped: the call's time is spent"; continue; fi
  echo "=== $p $(date +%T) (${SECONDS}s in)"; part "$p"
done
# The device returns at most 8 files: pack everything into one archive (Chrome traces left out if
# the archive would pass the 16 MiB limit).
# One archive name per run: two runs side by side must not pack into the same file.
TGZ=/tmp/results_$$.tgz
tar czf $TGZ -C "$OUT" . && [ $(stat -c %s $TGZ) -gt 15000000 ] && \
  tar czf $TGZ --exclude='trace_*' -C "$OUT" .
rm -rf "${OUT:?}"/* && mv $TGZ "$OUT"/results.tgz
