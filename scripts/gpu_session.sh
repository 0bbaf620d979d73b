#!/usr/bin/env bash
# One device call per part, each under the 10-minute limit; results land in $OUT.
#   bash scripts/gpu_session.sh validate   # every gpu-marked test (kernels, attention, graphs, modes)
#   bash scripts/gpu_session.sh latency    # P1 on 0.6B and 8B, P5 start-up, weight load of 8B
#   bash scripts/gpu_session.sh serving    # P2 throughput, P3 load test, overhead table, P4, profile
# Set PCG_COMMIT to the commit being measured (the device copy carries no .git).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PCG_COMMIT=${PCG_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B="python3 -m pcg_engine.cli bench"
M=/tmp/models; mkdir -p $M
model() {  # build a preset once on the GPU (random weights at the published shapes)
  [ -f $M/$1/config.json ] || python3 -m pcg_engine.cli make-model --preset $1 --out $M/$1 --device cuda >/dev/null
  echo $M/$1
}
case "${1:-validate}" in
  validate)
    timeout 300 python3 -m pytest -q -m gpu tests/compile -k "cuda_graphs" 2>&1 | tee $OUT/gpu_graphs.log | tail -15
    timeout 270 python3 -m pytest -q -m gpu tests -k "not cuda_graphs" 2>&1 | tee $OUT/gpu_rest.log | tail -25 ;;
  latency)
    q06=$(model qwen3-0.6b)
    timeout 240 $B latency --model $q06 --modes eager,full_decode,piecewise,full_and_piecewise \
      --num-iters 3 --warmup-iters 1 --json $OUT/p1_q06.json 2>&1 | tail -12
    timeout 120 $B startup --model $q06 --mode full_and_piecewise --json $OUT/p5_q06.json 2>&1 | tail -8
    q8=$(model qwen3-8b)
    timeout 60 $B load --model $q8 --device cuda --json $OUT/load_q8b.json 2>&1 | tail -14
    timeout 150 $B latency --model $q8 --modes full_decode,full_and_piecewise --num-iters 2 --warmup-iters 1 \
      --json $OUT/p1_q8b.json 2>&1 | tail -8 ;;
  serving)
    q06=$(model qwen3-0.6b)
    timeout 150 $B throughput --model $q06 --modes full_and_piecewise --json $OUT/p2_q06.json 2>&1 | tail -8
    timeout 180 $B load-test --model $q06 --modes full_decode,full_and_piecewise --num-prompts 300 \
      --request-rate 20 --input-len 1024 --output-len 128 --goodput ttft:200 tpot:20 --no-progress \
      --json $OUT/p3_q06.json 2>&1 | tail -12
    for n in 1 8 32; do   # issue 5's P3: TTFT of n concurrent 512-token prompts, piecewise vs eager prefill
      timeout 60 $B load-test --model $q06 --modes full_decode,full_and_piecewise --num-prompts $n \
        --request-rate inf --input-len 512 --output-len 2 --range-ratio 0 --no-progress \
        --json $OUT/ttft_512x$n.json 2>&1 | tail -6
    done
    timeout 60 $B overhead --host-only --model $q06 --batch-sizes 16,64,256 --json $OUT/p4_host.json 2>&1 | tail -8
    timeout 120 $B overhead --model $q06 --requests 64 --slots 64 --new-tokens 64 --json $OUT/overhead64.json 2>&1 | tail -12 ;;
  *) echo "usage: $0 validate|latency|serving"; exit 2 ;;
esac
