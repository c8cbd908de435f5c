#!/usr/bin/env bash
# One batched call on a lent GPU machine (see ../shared/gpu/README.md): carried wheels and the
# FlashAttention-4 bundle installed, then the stages named on the command line, each logging to
# $OUT. Stages:
#   tests          the GPU-marked tests (330-560 s; on a fresh H100 under auto on triton_fa4 at
#                  5f6175e it passed 62% in its 560 s): tests-runner and tests-kernels are its
#                  two halves, each with the 25 slowest tests listed, for one call each (362 and
#                  268 s on an H100 at 35bc58a)
#   runner         the runner, serve, TP=2, sampler and elementwise-kernel tests (~70 s)
#   tp2-tests      the TP=2-over-NCCL tests only (the two-GPU machine)
#   smoke          the runner tests, the attention backends and the sampler kernel (FA4's cases,
#                  ~5 s of compiling each, are fa4-tests')
#   kernels        kernel micro-benchmarks          moe   fused MoE tuning
#   profile        where a decode step's time goes at 256 rows; profile-32: at 32 rows of 1.5k;
#                  profile-prefill: the prompt steps of 256 requests of 562 tokens
#   decode-tests   the decode attention kernel's tests (merges repeated 200 times on one plan);
#                  prefill-tests: the prefill attention kernel's
#   decode-timeline  decode attention's programs stamping the global timer: launch, prologue,
#                  tile loop, merges, the spread of their ends, on tune-decode's shapes
#   tune-decode    decode attention configs and programs per SM on workload-like shapes;
#                  decode-pages: its default launch on 16- to 128-token pages, shuffled or in order
#   tune-prefill   prefill attention configs on workload A's 16k-token prompt steps
#   prefill-fa4    the default config on 16- and 128-token blocks and FlashAttention-4 (paged, carry
#                  .fa4) on the same prompt steps
#   ncu-decode     Nsight Compute on one decode attention launch at 64 and 256 rows (stall
#                  reasons, occupancy; Firecracker machines only: ../.library/device/KINDS.md)
#   host-profile   cProfile of the data plane's host time in steps that carry a prompt;
#                  host-profile-16k: in workload A's 16k-token prompt steps; host-timers: each
#                  phase's host time a step, clocked without a profiler, in both
#   sampler        the CUDA sampler by chunk size and warps at 1-256 rows
#   splitk         split-K o_proj/down_proj with the partials summed by the norm, against cuBLAS
#   decode-layer   a decode layer with our GEMMs against cuBLAS's, with and without PDL
#   gate-up        the layer as it runs at 48-128 rows, gate_up on our plain GEMM or cuBLAS's
#   overlap        a decode step as two half-batches on two streams, attention alternating
#   gemm-tiles     decode_matmul tiles at 64-256 rows, split-K tiles at 160-256 (the probes' --sweep)
#   gemm-stages    the layer as it runs at 8-128 rows with deeper pipelines in our GEMMs, and at
#                  160-256 rows with split-K at 3-5 stages
#   tma-gemm       the TMA GEMM's tiles against cuBLAS at 160-256 rows, alone and in the layer;
#                  tma-layer: only the layer as it runs against cuBLAS's qkv/gate_up, 160-256 rows;
#                  tma-gate-up: gate_up + SiLU on it at 64-128 rows, alone and in the layer;
#                  tma-lm-head: the LM head on it alone at 8-256 rows; tma-prefill: gate_up +
#                  SiLU on it alone at a prompt step's 8-16k rows, against cuBLAS + silu_and_mul
#   gemm-tests     the decode GEMM, TMA GEMM, split-K, elementwise and decode attention kernels' tests
#   gemm           the linear layers at 8-256 rows under CUDA graphs, cuBLAS and cuBLASLt
#   ab             bench/ab.py: workload A in-process, this tree's files against the versions in
#                  the directories AB names ("ab_old" or "ab_old ab_c"), alternating, ~30 s a run
#   bench-0.6b     workload A, both modes (~50 s), on auto's backend (triton_fa4 where .fa4 is
#                  carried on Hopper, else triton); bench-8b (~70 s), bench-30b likewise;
#                  bench-0.6b-triton: both modes on triton whatever is installed;
#                  bench-0.6b-nopdl: both modes without programmatic dependent launch;
#                  bench-0.6b-pd2: both modes with two steps in flight (--pipeline-depth 2);
#                  bench-0.6b-fa4: in-process with the flash_attn backend (carry .fa4);
#                  bench-0.6b-bs<N>: both modes on N-token KV blocks (bench-0.6b-bs128: FA4's size);
#                  bench-0.6b-tfa4: both modes on triton_fa4 (carry .fa4), on its 128-token blocks
#                  (FA4's TMA pages); bench-0.6b-tfa4-bs16: on 16 (FA4's cp.async gather);
#                  bench-8b-tfa4 likewise
#   fa4-tests      the flash_attn and triton_fa4 backends' tests, float32 runner ones included (carry .fa4)
#   bench-0.6b-si4 split with --stream-interval 4; bench-0.6b-fe0: gRPC in the engine's process;
#                  bench-0.6b-spy: split with py-spy sampling the server's processes (carry
#                  py-spy's wheel in .whl)
#                  bench-0.6b-tp2: split at TP=2 (the two-GPU machine)
#   engine-cpu     bench/engine_cpu.py on this host: the engine process's CPU a step against a
#                  simulated H200 (streams through a FrontendLink, a message a token)
#   serving-0.6b   bench/serving.py: Poisson arrivals, TTFT/TPOT/ITL, with and without a front-end
#   serving-0.6b-pg  the same (one front-end) with and without piecewise graphs for prompt steps
#                  (PG="on" or PG="off": only that one)
#   serving-0.6b-pd  the same (one front-end) at two and three steps in flight (--pipeline-depth)
# A machine takes ~40 s to start. Set SPLITSERVE_COMMIT to the hash, written out in the command
# (the device machine's copy of the tree may carry a stale .git: `git rev-parse` there once
# reported an older commit than the tree it ran):
#   OUT=$OUT SPLITSERVE_COMMIT=<hash of this tree> bash bench/gpu_run.sh tests bench-0.6b
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH
if [ -f .fa4/fa4site.tar.xz ] && [ ! -d /tmp/fa4site ]; then
  mkdir -p /tmp/fa4site && tar -xJf .fa4/fa4site.tar.xz -C /tmp/fa4site
fi
[ -d /tmp/fa4site ] && export PYTHONPATH=$PYTHONPATH:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
# serving_06b NAME ARGS...: bench/serving.py on Qwen3-0.6B shapes (Poisson rates 16 and 64 req/s,
# then all at once), its JSON to $OUT/serving-0.6b-NAME.json, its rows prefixed with NAME
serving_06b() {
  local name=$1; shift
  timeout 200 python3 bench/serving.py --model qwen3-0.6b --device cuda "$@" \
    --request-rates 16 64 inf --num-requests 512 --input-len 512 --output-len 256 \
    --goodput ttft:500 tpot:50 --out "$OUT/serving-0.6b-$name.json" 2>&1 \
    | grep -E "^rate|Error" | sed "s/^/$name /"
}
# gpu_pytest SECONDS NAME ARGS...: the GPU-marked tests pytest ARGS select, logged to
# $OUT/NAME.log, with their failures and counts printed
gpu_pytest() {
  local seconds=$1 name=$2; shift 2
  timeout "$seconds" python3 -m pytest -v -m gpu -p no:cacheprovider -o addopts= -rfE \
    --timeout 240 --tb=short "$@" > "$OUT/$name.log" 2>&1
  grep -E "FAILED|ERROR|Error|assert|passed|failed" "$OUT/$name.log" | tail -40
}
K=tests/dataplane/kernels
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests) gpu_pytest 560 tests --durations 25 tests/dataplane/test_gpu_runner.py \
             tests/dataplane/test_moe_vs_hf.py $K ;;
    tests-runner) gpu_pytest 560 tests-runner --durations 25 tests/dataplane/test_gpu_runner.py \
             tests/dataplane/test_moe_vs_hf.py $K/test_attention_backends.py $K/test_model_backends.py ;;
    tests-kernels) gpu_pytest 560 tests-kernels --durations 25 $K \
             --ignore $K/test_attention_backends.py --ignore $K/test_model_backends.py ;;
    runner) gpu_pytest 500 runner tests/dataplane/test_gpu_runner.py tests/dataplane/test_moe_vs_hf.py \
             $K/test_categorical_sample.py $K/test_elementwise.py $K/test_decode_inputs.py \
             $K/test_splitk_matmul.py ;;
    tp2-tests) gpu_pytest 300 tp2-tests -k tp2 tests/dataplane/test_gpu_runner.py ;;
    smoke) gpu_pytest "${SMOKE_TIMEOUT:-300}" smoke tests/dataplane/test_gpu_runner.py \
             $K/test_attention_backends.py $K/test_categorical_sample.py -k "not fa4 and not flash_attn" ;;
    decode-tests|prefill-tests) gpu_pytest 300 "$stage" "$K/test_paged_${stage%-tests}_attention.py" ;;
    kernels) timeout 150 python3 bench/kernels.py --out "$OUT/kernels.json" 2>&1 \
             | tee "$OUT/kernels.log" | tail -40 ;;
    moe) timeout 300 python3 bench/fused_moe.py --out "$OUT/fused_moe.json" 2>&1 | tail -30 ;;
    profile) timeout 200 python3 bench/profile_decode.py 2>&1 | grep -v Warning \
             | tee "$OUT/profile-256.log" | tail -70 ;;
    profile-prefill) timeout 200 python3 bench/profile_decode.py --phase prefill --prompt-len 562 \
             2>&1 | grep -v Warning | tee "$OUT/profile-prefill.log" | tail -70 ;;
    tune-prefill) timeout 300 python3 bench/tune_prefill.py "$OUT/tune_prefill.json" 2>&1 \
             | grep -v Warning | tail -4 ;;
    prefill-fa4) timeout 200 python3 bench/tune_prefill.py "$OUT/prefill_fa4.json" --no-grid 2>&1 \
             | grep -v Warning | tail -12 ;;
    tune-decode) timeout 300 python3 bench/tune_decode.py --out "$OUT/decode_tuning.json" 2>&1 \
             | tee "$OUT/tune-decode.log" | tail -20 ;;
    decode-pages) timeout 200 python3 bench/tune_decode.py --pages --out "$OUT/decode_pages.json" \
             2>&1 | grep -v Warning | tail -20 ;;
    host-profile) timeout 180 python3 bench/host_profile.py 2>&1 | tee "$OUT/host-profile.log" \
             | head -60 ;;
    host-profile-16k) timeout 180 python3 bench/host_profile.py --max-num-batched-tokens 16384 \
             --prompt-len 562 --num-prompts 96 2>&1 | tee "$OUT/host-profile-16k.log" | head -60 ;;
    host-timers) for args in "" "--max-num-batched-tokens 16384 --prompt-len 562 --num-prompts 96"; do
             timeout 180 python3 bench/host_profile.py --timers $args 2>&1 | grep -v Warning
           done | tee "$OUT/host-timers.log" ;;
    sampler) timeout 200 python3 bench/sampler_probe.py "$OUT/sampler.json" 2>&1 \
             | grep -v Warning | tail -62 ;;
    ncu-decode) for rows in 64 256; do timeout 150 ncu --clock-control none \
             --kernel-name regex:_decode_kernel --launch-skip 5 --launch-count 1 \
             --section LaunchStats --section Occupancy --section WarpStateStats \
             --section SchedulerStats --section MemoryWorkloadAnalysis \
             python3 bench/tune_decode.py --once $rows > "$OUT/ncu-decode-$rows.log" 2>&1
             tail -80 "$OUT/ncu-decode-$rows.log"; done ;;
    decode-timeline) timeout 200 python3 bench/decode_timeline_probe.py "$OUT/decode_timeline.json" \
             2>&1 | grep -v Warning | tail -20 ;;
    decode-layer) timeout 300 python3 bench/decode_layer_probe.py "$OUT/decode_layer.json" 2>&1 \
             | grep -v Warning | tail -14 ;;
    overlap) timeout 400 python3 bench/overlap_probe.py "$OUT/overlap.json" --programs 1 2 2>&1 \
             | grep -v Warning | tail -8 ;;
    gate-up) timeout 300 python3 bench/decode_layer_probe.py "$OUT/gate_up.json" --gate-up 2>&1 \
             | grep -v Warning | tail -6 ;;
    gemm-stages) timeout 300 python3 bench/decode_layer_probe.py "$OUT/decode_layer_stages.json" \
             --stages 2>&1 | grep -v Warning | tail -6
           timeout 300 python3 bench/decode_layer_probe.py "$OUT/decode_layer_long_stages.json" \
             --long-stages 2>&1 | grep -v Warning | tail -4 ;;
    tma-gemm) timeout 400 python3 bench/tma_gemm_probe.py "$OUT/tma_gemm.json" 2>&1 \
             | grep -v Warning | tail -12 ;;
    tma-layer) timeout 200 python3 bench/tma_gemm_probe.py "$OUT/tma_layer.json" --layer 2>&1 \
             | grep -v Warning | tail -8 ;;
    tma-gate-up) timeout 300 python3 bench/tma_gemm_probe.py "$OUT/tma_gate_up.json" --gate-up \
             2>&1 | grep -v Warning | tail -8 ;;
    tma-lm-head) timeout 300 python3 bench/tma_gemm_probe.py "$OUT/tma_lm_head.json" --lm-head \
             2>&1 | grep -v Warning | tail -8 ;;
    tma-prefill) timeout 300 python3 bench/tma_gemm_probe.py "$OUT/tma_prefill.json" --prefill \
             2>&1 | grep -v Warning | tail -4 ;;
    gemm-tiles) timeout 280 python3 bench/decode_layer_probe.py "$OUT/decode_layer_sweep.json" \
             --sweep 2>&1 | grep -v Warning | tail -12
           timeout 280 python3 bench/splitk_probe.py "$OUT/splitk_sweep.json" --sweep 2>&1 \
             | grep -v Warning | tail -8 ;;
    gemm-tests) gpu_pytest 300 gemm-tests $K/test_decode_matmul.py $K/test_tma_matmul.py \
             $K/test_splitk_matmul.py $K/test_elementwise.py $K/test_paged_decode_attention.py ;;
    splitk) timeout 300 python3 bench/splitk_probe.py "$OUT/splitk.json" 2>&1 | grep -v Warning \
             | tail -14 ;;
    gemm) timeout 200 python3 bench/gemm.py --out "$OUT/gemm.json" 2>&1 | tee "$OUT/gemm.log" \
             | tail -30 ;;
    profile-32) timeout 200 python3 bench/profile_decode.py --rows 32 --prompt-len 1500 2>&1 \
             | grep -v Warning | tee "$OUT/profile-32.log" | tail -70 ;;
    ab) timeout 560 python3 bench/ab.py ${AB:?set AB to the arm directories} \
             --rounds "${AB_ROUNDS:-2}" --out "$OUT/ab.json" 2>&1 | tail -12 ;;
    bench-0.6b) timeout 150 python3 bench/throughput.py --model qwen3-0.6b --out-dir "$OUT" 2>&1 | tail -20 ;;
    bench-0.6b-nopdl) timeout 150 python3 bench/throughput.py --model qwen3-0.6b --no-pdl --out-dir "$OUT" 2>&1 | tail -20 ;;
    bench-0.6b-bs*) timeout 150 python3 bench/throughput.py --model qwen3-0.6b \
             --block-size "${stage#bench-0.6b-bs}" --out-dir "$OUT" 2>&1 | tail -20 ;;
    bench-0.6b-triton) timeout 150 python3 bench/throughput.py --model qwen3-0.6b \
             --attention-backend triton --out-dir "$OUT" 2>&1 | tail -20 ;;
    bench-0.6b-tfa4) timeout 200 python3 bench/throughput.py --model qwen3-0.6b \
             --attention-backend triton_fa4 --out-dir "$OUT" 2>&1 | tail -20 ;;
    bench-0.6b-tfa4-bs16) timeout 200 python3 bench/throughput.py --model qwen3-0.6b \
             --attention-backend triton_fa4 --block-size 16 --out-dir "$OUT" 2>&1 | tail -20 ;;
    fa4-tests) gpu_pytest 300 fa4-tests $K/test_attention_backends.py tests/dataplane/test_gpu_runner.py \
             $K/test_model_backends.py -k "fa4 or flash_attn or make_backend" ;;
    bench-0.6b-pd2) timeout 150 python3 bench/throughput.py --model qwen3-0.6b --pipeline-depth 2 --out-dir "$OUT" 2>&1 | tail -20 ;;
    bench-0.6b-fa4) timeout 240 python3 bench/throughput.py --model qwen3-0.6b --modes inprocess \
             --attention-backend flash_attn --out-dir "$OUT" 2>&1 | tail -20 ;;
    bench-8b) timeout 240 python3 bench/throughput.py --model qwen3-8b --out-dir "$OUT" 2>&1 | tail -20 ;;
    bench-8b-tfa4) timeout 280 python3 bench/throughput.py --model qwen3-8b \
             --attention-backend triton_fa4 --out-dir "$OUT" 2>&1 | tail -20 ;;
    bench-30b) timeout 300 python3 bench/throughput.py --model qwen3-30b-a3b --out-dir "$OUT" 2>&1 | tail -20 ;;
    bench-0.6b-si4) timeout 150 python3 bench/throughput.py --model qwen3-0.6b --modes split --stream-interval 4 --out-dir "$OUT" 2>&1 | tail -20 ;;
    bench-0.6b-spy) timeout 150 python3 bench/throughput.py --model qwen3-0.6b --modes split \
             --spy /tmp/split.raw --out-dir "$OUT" 2>&1 | tail -20 ;;
    bench-0.6b-fe0) timeout 150 python3 bench/throughput.py --model qwen3-0.6b --modes split --frontends 0 --out-dir "$OUT" 2>&1 | tail -20 ;;
    engine-cpu) timeout 120 python3 bench/engine_cpu.py --stream-interval 1 --frontend-link \
             --simulated-device --repeat 3 2>>"$OUT/engine_cpu.log" | tee -a "$OUT/engine_cpu.jsonl" \
             | cut -c1-400 ;;
    serving-0.6b) for fe in 1 0; do serving_06b fe$fe --frontends $fe; done ;;
    serving-0.6b-pg) for pg in ${PG:-on off}; do extra=(); [ $pg = off ] && extra=(--serve-arg=--no-prompt-graphs)
             serving_06b pg-$pg "${extra[@]}"; done ;;
    serving-0.6b-pd) for pd in 2 3; do serving_06b pd$pd --serve-arg=--pipeline-depth=$pd; done ;;
    bench-0.6b-tp2) timeout 400 python3 bench/throughput.py --model qwen3-0.6b --modes split --tp 2 --out-dir "$OUT" 2>&1 | tail -20 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
echo "=== done $(date +%T)"
