#!/usr/bin/env bash
# BERT-large on several nodes: TP=2 with sequence parallelism, PP=2, the rest data parallel; run this script once on
# every node (by hand with NNODES/NODE_RANK/MASTER_ADDR, or as the step of a SLURM job, which sets them).
# Usage: NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<host of node 0> DATA=... VOCAB=... bash examples/pretrain_bert_distributed.sh
#        sbatch --nodes 4 --ntasks-per-node 1 --gpus-per-node 8 --wrap "srun bash examples/pretrain_bert_distributed.sh"
set -euo pipefail
NNODES=${NNODES:-${SLURM_NNODES:?set NNODES or run under SLURM}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:?set NODE_RANK or run under SLURM}}
if [ -z "${MASTER_ADDR:-}" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
: "${MASTER_ADDR:?set MASTER_ADDR}" "${DATA:?set DATA to a _text_sentence prefix}" "${VOCAB:?set VOCAB}"
CKPT=${CKPT:-checkpoints/bert-large-distributed}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
source "$(dirname "${BASH_SOURCE[0]}")/bert_large_flags.sh"
torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "${GPUS_PER_NODE:-8}" \
    --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" pretrain_bert.py "${BERT_LARGE_ARGS[@]}" \
    --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 \
    --micro-batch-size 8 --global-batch-size "${GLOBAL_BATCH:-1024}" --train-iters 500000 \
    --lr 2e-4 --min-lr 2e-5 --lr-decay-style linear --lr-decay-iters 490000 --lr-warmup-fraction 0.01 \
    --save-interval 5000
