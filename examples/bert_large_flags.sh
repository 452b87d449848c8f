# BERT-large's model, regularisation, precision, data, logging and checkpoint flags, shared by pretrain_bert.sh and
# pretrain_bert_distributed.sh (sourced, not run). Reads DATA, VOCAB and CKPT (and TOKENIZER, MINUTES if set);
# sets the bash array BERT_LARGE_ARGS. The calling script adds its layout, batch sizes, schedule and save interval.
BERT_LARGE_ARGS=(
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512 --max-position-embeddings 512
    --weight-decay 1e-2 --clip-grad 1.0 --init-method-std 0.02
    --bf16 --use-distributed-optimizer --overlap-grad-reduce
    --mask-prob 0.15 --short-seq-prob 0.1
    --data-path "$DATA" --split 949,50,1
    --tokenizer-type "${TOKENIZER:-BertWordPieceLowerCase}" --vocab-file "$VOCAB"
    --log-interval 100 --log-throughput --tensorboard-dir "$CKPT/tensorboard"
    --eval-interval 1000 --eval-iters 10
    --save "$CKPT" --load "$CKPT" --exit-duration-in-mins "${MINUTES:-230}"
)
