#!/usr/bin/env bash
# Quickstart: preprocess the bundled corpus, train a tiny GPT on CPU, evaluate, save a checkpoint, resume;
# then the same for a tiny BERT (a WordPiece vocabulary learnt from the corpus, sentence-split data).
set -euo pipefail
cd "$(dirname "$0")/.."
bash examples/install.sh
PY=${PYTHON:-python3}
OUT=${OUT_DIR:-runs/quickstart}
mkdir -p "$OUT/data"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

echo "== 1/6 preprocess data/tinyshakespeare.jsonl.gz -> $OUT/data/quickstart_text_document.{bin,idx}"
"$PY" tools/preprocess_data.py --input data/tinyshakespeare.jsonl.gz --output-prefix "$OUT/data/quickstart" \
    --tokenizer-type GPT2BPETokenizer --vocab-file data/gpt2-vocab.json --merge-file data/gpt2-merges.txt \
    --append-eod --workers 2

MODEL_ARGS=(
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64
    --micro-batch-size 4 --global-batch-size 8
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 10 --lr-decay-iters 120 --weight-decay 0.1 --clip-grad 1.0
    --data-path "$OUT/data/quickstart_text_document" --split 98,2,0
    --tokenizer-type GPT2BPETokenizer --vocab-file data/gpt2-vocab.json --merge-file data/gpt2-merges.txt
    --log-interval 10 --log-throughput --eval-interval 50 --eval-iters 5
    --save "$OUT/checkpoints" --save-interval 50 --tensorboard-dir "$OUT/tensorboard"
    --num-workers 0 --seed 1234
)

echo "== 2/6 train a tiny GPT: 120 iterations planned, stop after 100 (--exit-interval saves, then exits)"
"$PY" pretrain_gpt.py "${MODEL_ARGS[@]}" --train-iters 120 --exit-interval 100

echo "== 3/6 resume the GPT from its checkpoint and train 20 more iterations"
"$PY" pretrain_gpt.py "${MODEL_ARGS[@]}" --train-iters 120 --load "$OUT/checkpoints"


echo "== 4/6 learn a WordPiece vocabulary from the corpus -> $OUT/data/bert-vocab.txt"
"$PY" tools/learn_wordpiece_vocab.py --input data/tinyshakespeare.jsonl.gz --vocab-size 8000 --min-frequency 2 \
    --output "$OUT/data/bert-vocab.txt"

echo "== 5/6 split the corpus into sentences and WordPiece-tokenise it -> $OUT/data/quickstart_bert_text_sentence"
"$PY" tools/preprocess_data.py --input data/tinyshakespeare.jsonl.gz --output-prefix "$OUT/data/quickstart_bert" \
    --tokenizer-type BertWordPieceLowerCase --vocab-file "$OUT/data/bert-vocab.txt" --split-sentences --workers 2

BERT_ARGS=(
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64
    --micro-batch-size 16 --global-batch-size 16
    --lr 5e-3 --min-lr 5e-4 --lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.01 --clip-grad 1.0
    --data-path "$OUT/data/quickstart_bert_text_sentence" --split 95,5,0
    --tokenizer-type BertWordPieceLowerCase --vocab-file "$OUT/data/bert-vocab.txt"
    --log-interval 10 --eval-interval 50 --eval-iters 4
    --save "$OUT/bert-checkpoints" --save-interval 50 --num-workers 0 --seed 1234
)

echo "== 6/6 train a tiny BERT (masked LM + sentence order): stop after 80 of 100 iterations, then resume"
"$PY" pretrain_bert.py "${BERT_ARGS[@]}" --train-iters 100 --exit-interval 80
"$PY" pretrain_bert.py "${BERT_ARGS[@]}" --train-iters 100 --load "$OUT/bert-checkpoints"

echo
echo "Checkpoints: $OUT/checkpoints (latest: $(cat "$OUT/checkpoints/latest_checkpointed_iteration.txt"))"
echo "TensorBoard: tensorboard --logdir $OUT/tensorboard"
echo "BERT checkpoints: $OUT/bert-checkpoints"
echo "Resume again: python3 pretrain_gpt.py <same flags> --train-iters N --load $OUT/checkpoints"
