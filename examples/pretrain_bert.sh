#!/usr/bin/env bash
# BERT-large (336M: 24 layers, hidden 1024, 16 heads, sequence 512) on one node of 8 GPUs: DP=8, bf16, the
# sentence-order head. DATA is a prefix made by tools/preprocess_data.py --split-sentences with the same vocabulary.
# Usage: DATA=/path/corpus_text_sentence VOCAB=bert-large-uncased-vocab.txt bash examples/pretrain_bert.sh
set -euo pipefail
: "${DATA:?set DATA to a _text_sentence prefix}" "${VOCAB:?set VOCAB to a WordPiece vocab.txt}"
CKPT=${CKPT:-checkpoints/bert-large}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
source "$(dirname "${BASH_SOURCE[0]}")/bert_large_flags.sh"
torchrun --nproc_per_node "${GPUS:-8}" pretrain_bert.py "${BERT_LARGE_ARGS[@]}" \
    --micro-batch-size 4 --global-batch-size 32 --train-iters 2000000 \
    --lr 1e-4 --min-lr 1e-5 --lr-decay-style linear --lr-decay-iters 990000 --lr-warmup-fraction 0.01 \
    --save-interval 10000
