#!/usr/bin/env bash
# A Llama-3.2-1B-shaped decoder (16 layers, hidden 2048, 32 query heads in 8 key/value groups, SwiGLU MLP of 8192,
# RMSNorm, RoPE theta 500,000 with Llama 3.1's frequency scaling, no biases) on one node of 8 GPUs: DP=8 with the
# distributed optimizer, bf16, 8192-token samples, a Hugging Face tokenizer.json (the Llama 3 tokenizer: 128,000
# tokens and 256 special ones). The model flags are Megatron-LM's Llama-3 block as its scripts write it; Llama 3.2
# 1B itself ties its output layer to the embedding: leave out --untie-embeddings-and-output-weights for that.
# Check memory and speed first with --dry-run (no GPU touched):  DRY_RUN=1 bash examples/pretrain_llama.sh
# Usage: DATA=/path/corpus_text_document TOKENIZER=/path/tokenizer.json bash examples/pretrain_llama.sh [FLAGS]
# FLAGS after the script's name override its own (the last value of a flag counts): a tiny model on CPU, say, is
#   GPUS=1 ... bash examples/pretrain_llama.sh --num-layers 2 --hidden-size 64 --num-attention-heads 4 \
#       --num-query-groups 2 --ffn-hidden-size 128 --seq-length 64 --global-batch-size 8 --train-iters 30
# (the data preprocessed with the same tokenizer: tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer
#  --tokenizer-model "$TOKENIZER" --append-eod ...)
set -euo pipefail
: "${DATA:?set DATA to a preprocessed prefix}" "${TOKENIZER:?set TOKENIZER to a tokenizer.json}"
CKPT=${CKPT:-checkpoints/llama-1b}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}

LLAMA3_MODEL_ARGS=(
    --position-embedding-type rope --rotary-base 500000 --use-rope-scaling --normalization RMSNorm
    --norm-epsilon 1e-5 --swiglu --ffn-hidden-size 8192 --group-query-attention --num-query-groups 8
    --disable-bias-linear --untie-embeddings-and-output-weights
)
SIZES=(
    --num-layers 16 --hidden-size 2048 --num-attention-heads 32 --kv-channels 64
    --seq-length 8192 --max-position-embeddings 131072 --rope-scaling-factor 32
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
)
TRAINING=(
    --micro-batch-size 1 --global-batch-size 128 --train-iters 100000
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0
    --adam-beta1 0.9 --adam-beta2 0.95
    --bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
DATA_ARGS=(
    --data-path "$DATA" --split 990,9,1
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
)
OUTPUT=(
    --log-interval 10 --log-throughput --tensorboard-dir "$CKPT/tensorboard"
    --eval-interval 1000 --eval-iters 10
    --save "$CKPT" --load "$CKPT" --save-interval 1000 --exit-duration-in-mins "${MINUTES:-230}"
)
if [[ -n "${DRY_RUN:-}" ]]; then
    exec python pretrain_gpt.py "${LLAMA3_MODEL_ARGS[@]}" "${SIZES[@]}" "${TRAINING[@]}" "${DATA_ARGS[@]}" \
        "${OUTPUT[@]}" "$@" --dry-run "${GPUS:-8}"
fi
torchrun --nproc_per_node "${GPUS:-8}" pretrain_gpt.py \
    "${LLAMA3_MODEL_ARGS[@]}" "${SIZES[@]}" "${TRAINING[@]}" "${DATA_ARGS[@]}" "${OUTPUT[@]}" "$@"
