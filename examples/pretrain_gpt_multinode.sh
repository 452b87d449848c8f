#!/usr/bin/env bash
# GPT on several nodes with torchrun's rendezvous; run this script once on every node.
# Usage: NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<host of node 0> DATA=... VOCAB=... MERGES=... \
#        bash examples/pretrain_gpt_multinode.sh [more pretrain_gpt.py flags]
set -euo pipefail
: "${NNODES:?}" "${NODE_RANK:?}" "${MASTER_ADDR:?}" "${DATA:?}" "${VOCAB:?}" "${MERGES:?}"
CKPT=${CKPT:-checkpoints/gpt-multinode}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "${GPUS_PER_NODE:-8}" \
    --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" pretrain_gpt.py \
    --tensor-model-parallel-size 8 --sequence-parallel --pipeline-model-parallel-size "${PP:-2}" \
    --num-layers-per-virtual-pipeline-stage 2 \
    --num-layers 40 --hidden-size 5120 --num-attention-heads 40 --seq-length 2048 --max-position-embeddings 2048 \
    --micro-batch-size 1 --global-batch-size 512 --train-iters 200000 \
    --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01 --weight-decay 0.1 \
    --bf16 --use-distributed-optimizer --overlap-grad-reduce --recompute-granularity selective \
    --data-path "$DATA" --split 949,50,1 \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" \
    --log-interval 10 --log-throughput --tensorboard-dir "$CKPT/tensorboard" \
    --eval-interval 2000 --eval-iters 10 --save "$CKPT" --load "$CKPT" --save-interval 1000 "$@"
