#!/usr/bin/env bash
# GPT (~1.3B) on one node of 8 GPUs: TP=2 with sequence parallelism, DP=4, distributed optimizer, bf16.
# Usage: DATA=/path/corpus_text_document VOCAB=gpt2-vocab.json MERGES=gpt2-merges.txt bash examples/pretrain_gpt_1node.sh
set -euo pipefail
: "${DATA:?set DATA to a preprocessed prefix}" "${VOCAB:?set VOCAB}" "${MERGES:?set MERGES}"
CKPT=${CKPT:-checkpoints/gpt-1.3b}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
torchrun --nproc_per_node "${GPUS:-8}" pretrain_gpt.py \
    --tensor-model-parallel-size 2 --sequence-parallel \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 \
    --micro-batch-size 8 --global-batch-size 256 --train-iters 100000 \
    --lr 2e-4 --min-lr 2e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01 --weight-decay 0.1 --clip-grad 1.0 \
    --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.02 --attention-dropout 0.0 --hidden-dropout 0.0 \
    --bf16 --use-distributed-optimizer --overlap-grad-reduce \
    --data-path "$DATA" --split 949,50,1 \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" \
    --log-interval 10 --log-throughput --tensorboard-dir "$CKPT/tensorboard" \
    --eval-interval 1000 --eval-iters 10 \
    --save "$CKPT" --load "$CKPT" --save-interval 1000 --exit-duration-in-mins "${MINUTES:-230}"
