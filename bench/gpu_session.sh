#!/usr/bin/env bash
# What issue 7 records, in two GPU-machine calls of under 10 minutes each on one H200:
#   bash bench/gpu_session.sh tests [RESULTS_DIR]   the GPU tests (fused kernels, attention backends, FP8, fused
#                                                   and FP8 50-iteration training, CUDA graph): ~6 min
#   bash bench/gpu_session.sh table [RESULTS_DIR]   the throughput table, peers, ours and ours-fp8, both shapes,
#                                                   one run: ~6 min
#   bash bench/gpu_session.sh sweep [RESULTS_DIR]   the LayerNorm and FP8-cast launch sweeps; the best
#                                                   configurations are written into megatron/core/fusions/
#                                                   _triton_layer_norm.py and _triton_fp8.py (commit them)
# RESULTS_DIR defaults to bench/results. A failing test stops the script with a non-zero status.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:?tests, table or sweep}
R=${2:-bench/results}
mkdir -p "$R/logs"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
case "$what" in
  tests)
    python -m pytest -q tests/gpu/test_fused_kernels.py tests/gpu/test_attention_backends.py tests/gpu/test_fp8_gemms.py \
        tests/gpu/test_fused_training.py tests/gpu/test_cuda_graph.py 2>&1 | tee "$R/gpu_tests.log" | tail -3 ;;
  table)
    python bench/gpu_throughput.py --iters 10 --warmup 5 --results-dir "$R" --log-dir "$R/logs" \
        --ours-shape-args "1.3b:--recompute-granularity selective --recompute-modules mlp_act --recompute-num-layers 12" \
        --ours-shape-args "124m:--enable-cuda-graph" --ours-fp8-shape-args "124m:--enable-cuda-graph" | grep "^|" ;;
  sweep)
    python bench/kernel_sweep.py --only layer_norm --apply-layer-norm --out "$R/kernel_sweep_ln.json" | tail -3
    python bench/kernel_sweep.py --only fp8 --apply-fp8 --out "$R/kernel_sweep_fp8.json" | tail -3 ;;
  *) echo "unknown step $what (tests, table or sweep)" >&2; exit 2 ;;
esac
