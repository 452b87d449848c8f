#!/usr/bin/env bash
# One GPU-machine call that refreshes everything issue 7 records (about 9 minutes on one H200): the LayerNorm
# launch sweep (its best configuration is written into megatron/core/fusions/_triton_layer_norm.py: commit it
# with the results), the GPU tests, and the full throughput table (peers and ours, both shapes, one run).
#   bash bench/gpu_session.sh [RESULTS_DIR]        (default: bench/results)
# A failing test stops the script before anything is benchmarked.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${1:-bench/results}
mkdir -p "$R/logs"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python bench/kernel_sweep.py --only layer_norm --apply-layer-norm --out "$R/kernel_sweep_ln.json" | tail -3
python -m pytest -q tests/gpu/test_fused_kernels.py tests/gpu/test_fused_training.py tests/gpu/test_cuda_graph.py \
    2>&1 | tee "$R/gpu_tests.log" | tail -3
python bench/gpu_throughput.py --iters 10 --warmup 5 --results-dir "$R" --log-dir "$R/logs" \
    --ours-shape-args "1.3b:--recompute-granularity selective --recompute-modules mlp_act --recompute-num-layers 12" \
    --ours-shape-args "124m:--enable-cuda-graph" | grep "^|"
