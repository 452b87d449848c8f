#!/usr/bin/env bash
# The GPU measurements of the project, one step per call (each well under ten minutes on one H200):
#   bash bench/gpu_session.sh tests [RESULTS_DIR]   the GPU tests (fused kernels, attention backends, FP8, fused
#                                                   and FP8 50-iteration training, CUDA graph): ~4 min
#   bash bench/gpu_session.sh table [RESULTS_DIR]   the throughput table: peers, ours and ours-fp8 (delayed
#                                                   scaling), both shapes, one run: ~4 min
#   bash bench/gpu_session.sh recompute [RESULTS_DIR]   ours at 1.3B under each recomputation setting (none,
#                                                   selective both / mlp_act, full uniform / block), one table: ~4 min
#   bash bench/gpu_session.sh check [RESULTS_DIR]   a quick look after a change: the kernel, FP8 and optimizer GPU
#                                                   tests, then ours (bf16) at both shapes without peers: ~2 min
#   bash bench/gpu_session.sh multi [RESULTS_DIR]   needs 2 GPUs: the NCCL tests (TP, PP, and pretrain_gpt.py under
#                                                   torchrun in every layout against one GPU) and bench/multi_gpu.py
#                                                   (1.3B on 1 GPU, DP2, TP2+SP, PP2): ~5 min
#   bash bench/gpu_session.sh ab BASE [TAG]         this tree against the checkout BASE (e.g. made with
#                                                   git archive REF | tar -x -C scratch/base), interleaved, two
#                                                   rounds: ours-fp8 (delayed, CUDA graph) at both shapes and
#                                                   ours (bf16, CUDA graph) at 124M; bench/results/ab_TAG: ~5 min
#   bash bench/gpu_session.sh sweep [RESULTS_DIR]   the LayerNorm, FP8-cast and column-sum launch sweeps; each
#                                                   prints its best configuration (the library is not edited)
# RESULTS_DIR defaults to bench/results. A failing test stops the script with a non-zero status.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:?tests, table, recompute, check, multi, ab or sweep}
R=${2:-bench/results}
[ "$what" = ab ] || mkdir -p "$R/logs"  # ab's second argument is the baseline checkout, not a results folder
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
case "$what" in
  tests)
    python -m pytest -q tests/gpu/test_fused_kernels.py tests/gpu/test_attention_backends.py tests/gpu/test_fp8_gemms.py \
        tests/unit/optimizer/test_fused_adamw.py \
        tests/gpu/test_fused_training.py tests/gpu/test_cuda_graph.py 2>&1 | tee "$R/gpu_tests.log" | tail -3 ;;
  table)
    python bench/gpu_throughput.py --iters 10 --warmup 5 --results-dir "$R" --log-dir "$R/logs" \
        --ours-shape-args "1.3b:--recompute-granularity selective --recompute-modules mlp_act --recompute-num-layers 12" \
        --ours-shape-args "124m:--enable-cuda-graph" --ours-fp8-shape-args "124m:--enable-cuda-graph --fp8-recipe delayed" \
        --ours-fp8-shape-args "1.3b:--enable-cuda-graph --fp8-recipe delayed" | grep "^|" ;;
  recompute)
    python bench/gpu_throughput.py --trainers ours --shapes 1.3b --iters 10 --warmup 5 --results-dir "$R" \
        --log-dir "$R/logs" --tag recompute --variant "none:" \
        --variant "selective:--recompute-granularity selective" \
        --variant "selective_mlp_act:--recompute-granularity selective --recompute-modules mlp_act" \
        --variant "full_block_12:--recompute-granularity full --recompute-method block --recompute-num-layers 12" \
        --variant "full_uniform_1:--recompute-granularity full --recompute-method uniform --recompute-num-layers 1" \
        | grep "^| ours" ;;
  check)
    python -m pytest -q tests/unit/optimizer/test_fused_adamw.py tests/gpu/test_fused_kernels.py \
        tests/gpu/test_fp8_gemms.py 2>&1 | tee "$R/gpu_tests_check.log" | tail -3
    python bench/gpu_throughput.py --trainers ours --iters 8 --warmup 4 --results-dir "$R" --log-dir "$R/logs" \
        --tag check --ours-shape-args "1.3b:--recompute-granularity selective --recompute-modules mlp_act --recompute-num-layers 12" \
        --ours-shape-args "124m:--enable-cuda-graph" | grep "^| ours" ;;
  multi)
    export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    python bench/multi_gpu.py --results-dir "$R" | grep -E "^\|"
    python -m pytest -q tests/unit/tensor_parallel/test_tp_nccl.py tests/unit/pipeline_parallel/test_pp_nccl.py \
        tests/gpu/test_multi_gpu_training.py 2>&1 | tee "$R/gpu_tests_multi_gpu.log" | tail -3 ;;
  ab)
    base=${2:?ab needs the baseline checkout BASE}
    python bench/ab_trees.py --tree "base=$base" --tree new=. --rounds 2 --tag "${3:-latest}" \
        --case "124m:ours-fp8:--enable-cuda-graph --fp8-recipe delayed" \
        --case "1.3b:ours-fp8:--enable-cuda-graph --fp8-recipe delayed" --case "124m:ours:--enable-cuda-graph" \
        | grep -E "^\|" ;;
  sweep)
    python bench/kernel_sweep.py --only layer_norm --out "$R/kernel_sweep_ln.json" | grep -A9 "^Best"
    python bench/kernel_sweep.py --only fp8 --out "$R/kernel_sweep_fp8.json" | grep -A9 "^Best"
    python bench/kernel_sweep.py --only colsum --out "$R/kernel_sweep_colsum.json" | grep -A9 "^Best" ;;
  *) echo "unknown step $what (tests, table, recompute, check, multi, ab or sweep)" >&2; exit 2 ;;
esac
