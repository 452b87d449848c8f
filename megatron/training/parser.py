"""The implemented flags: Megatron-LM's names, meanings and defaults (differences: flag_table.DEFAULT_DIFFERENCES).

Each flag's ``dest`` is the field of the config section it lands in (``config.py``). Model-shape flags that
``--use-checkpoint-args`` may fill default to None here; ``arguments.CHECKPOINT_ARGS`` gives their defaults.
"""

from __future__ import annotations

import argparse

from megatron.core.fusions.fp8 import FP8_FORMATS


def _model(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None, help="number of transformer layers")
    g.add_argument("--hidden-size", type=int, default=None, help="transformer hidden size")
    g.add_argument("--num-attention-heads", type=int, default=None, help="number of attention heads")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP hidden size (default 4 x --hidden-size)")
    g.add_argument("--seq-length", type=int, default=None, help="tokens per training sample")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="size of the position-embedding table (default --seq-length)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                   help="pad the vocabulary to a multiple of this times the tensor-parallel size (default 128)")
    g.add_argument("--norm-epsilon", type=float, default=None, help="epsilon of the norm layers (default 1e-5)")
    g.add_argument("--apply-layernorm-1p", action="store_true", default=None,
                   help="zero-centred LayerNorm gamma (the weight is stored as gamma - 1)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None,
                   help="give the output layer its own weight instead of sharing the input embedding's")
    g.add_argument("--position-embedding-type", default=None, choices=["learned_absolute", "rope", "none"],
                   help="position embeddings: a learned table (learned_absolute), rotary (rope) or none")
    g.add_argument("--rotary-base", type=int, default=None, help="RoPE: base of the rotary frequencies (default 10000)")
    g.add_argument("--rotary-percent", type=float, default=None,
                   help="RoPE: fraction of each head's channels that are rotated (default 1.0)")
    g.add_argument("--rotary-interleaved", action="store_true", default=None,
                   help="RoPE: rotate channel pairs (2i, 2i+1) instead of (i, i + d/2)")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                   help="RoPE: divide positions by this factor (linear position interpolation)")
    g.add_argument("--use-rope-scaling", action="store_true", default=None,
                   help="RoPE: Llama 3.1's frequency scaling (low/high frequency factors 1 and 4, original "
                        "context 8192)")
    g.add_argument("--rope-scaling-factor", type=float, default=None,
                   help="RoPE: the factor of --use-rope-scaling (default 8.0)")
    g.add_argument("--normalization", default=None, choices=["LayerNorm", "RMSNorm"],
                   help="normalisation layer: LayerNorm or RMSNorm (default LayerNorm)")
    g.add_argument("--swiglu", action="store_true", default=None,
                   help="gated SiLU MLP (SwiGLU); --ffn-hidden-size defaults to 2/3 x 4h rounded down to 64")
    g.add_argument("--group-query-attention", action="store_true", default=None,
                   help="grouped-query attention: --num-query-groups key/value heads")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="key/value heads under --group-query-attention (1: multi-query attention; default 1)")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="channels per attention head (default --hidden-size / --num-attention-heads)")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false", default=None,
                   help="no biases in the linear layers")
    g.add_argument("--add-qkv-bias", action="store_true", default=None,
                   help="a bias on the QKV projection even with --disable-bias-linear (Qwen2)")
    g.add_argument("--qk-layernorm", action="store_true", default=None,
                   help="normalise each query and key head before the attention scores")
    g.add_argument("--transformer-impl", default="local",
                   help="transformer implementation: local (this framework's own layers)")
    g.add_argument("--init-method-std", type=float, default=0.02, help="standard deviation of the weight init")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "flash", "fused", "unfused", "local"],
                   help="auto: PyTorch's SDPA picks the kernel; flash: SDPA's flash kernel only; fused: SDPA's "
                        "cuDNN kernel only (flash and fused need CUDA); unfused/local: explicit "
                        "scale-mask-softmax")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="dropout on the attention probabilities")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="dropout on the residual branches")


def _optimizer(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer and schedule")
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"], help="adam (AdamW) or sgd")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (required)")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of the decay")
    g.add_argument("--lr-decay-style", default="linear", choices=["constant", "linear", "cosine"],
                   help="shape of the decay after warm-up")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="iterations of linear warm-up from 0")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="iterations over which the learning rate decays (default --train-iters)")
    g.add_argument("--weight-decay", type=float, default=0.01, help="decoupled weight decay (not on biases/norms)")
    g.add_argument("--clip-grad", type=float, default=1.0, help="clip the global gradient norm to this (0: off)")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum")
    g.add_argument("--no-fused-adamw", dest="fused_adamw", action="store_false",
                   help="on CUDA, use torch's fused AdamW and a separate copy into the bf16/fp16 params instead of "
                        "the Triton AdamW that writes them in its update")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the fp32 main weights and optimizer states over the data-parallel ranks")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="all-gather updated parameters while the next forward runs (distributed optimizer)")


def _precision(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true", help="bf16 parameters and activations, fp32 main weights")
    g.add_argument("--fp16", action="store_true", help="fp16 parameters and activations with loss scaling")
    g.add_argument("--loss-scale", type=float, default=None, help="fp16: a fixed loss scale (default dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32, help="fp16: the first dynamic loss scale")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="fp16: the dynamic scale's lower bound")
    g.add_argument("--loss-scale-window", type=float, default=1000,
                   help="fp16: iterations without overflow before the scale doubles")
    g.add_argument("--hysteresis", type=int, default=2, help="fp16: overflows tolerated before the scale halves")
    g.add_argument("--fp8-format", default=None, choices=list(FP8_FORMATS),
                   help="FP8 GEMMs in the transformer layers' linears (needs --bf16 and an FP8 GPU, sm89+): e4m3 "
                        "everywhere, or hybrid (E5M2 output gradients)")
    g.add_argument("--fp8-recipe", default="tensorwise", choices=["tensorwise", "delayed"],
                   help="FP8 scaling: tensorwise = each tensor scaled by its own current amax; delayed = by the "
                        "amax its quantization site saw in earlier iterations (no amax pass before the cast)")
    g.add_argument("--fp8-amax-history-len", type=int, default=1,
                   help="--fp8-recipe delayed: iterations of amax history per quantization site")
    g.add_argument("--fp8-amax-compute-algo", default="most_recent", choices=["most_recent", "max"],
                   help="--fp8-recipe delayed: the scale's amax is the latest one or the history's maximum")
    g.add_argument("--fp8-margin", type=int, default=0, help="FP8 scale = fp8_max / amax / 2^margin")


def _training(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batches, iterations and stopping")
    g.add_argument("--micro-batch-size", type=int, default=None, help="samples per microbatch per rank (required)")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per iteration over all data-parallel ranks (default micro batch x DP)")
    g.add_argument("--train-iters", type=int, default=None, help="iterations to train")
    g.add_argument("--train-samples", type=int, default=None, help="samples to train (instead of --train-iters)")
    g.add_argument("--eval-interval", type=int, default=1000, help="evaluate on the validation split every N its")
    g.add_argument("--eval-iters", type=int, default=100, help="iterations per evaluation (0: no evaluation)")
    g.add_argument("--dry-run", nargs="?", type=int, const=0, default=None, metavar="NUM_GPUS",
                   help="pretrain_gpt.py: check the flags, print the planner's memory and time prediction on "
                        "NUM_GPUS GPUs (default: the launcher's world size) and exit 0, touching no GPU")
    g.add_argument("--skip-train", action="store_true", help="only evaluate (after loading --load)")
    g.add_argument("--exit-interval", type=int, default=None, help="save and exit at iterations divisible by N")
    g.add_argument("--exit-duration-in-mins", type=float, default=None, help="save and exit after N minutes")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on the --exit-signal, finish the current iteration, save a checkpoint on every rank and "
                        "exit with status 0")
    g.add_argument("--exit-signal", default="SIGTERM", choices=["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"],
                   help="the signal --exit-signal-handler acts on (SIGUSR1 for SLURM's --signal=USR1@SECONDS "
                        "pre-warning)")
    g.add_argument("--max-consecutive-skipped-iterations", type=int, default=100, metavar="N",
                   help="stop with an error after N consecutive iterations that skipped their update (fp16 "
                        "overflow at every loss scale, a non-finite gradient norm); 0: never stop")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_true",
                   default=True, help="stop with an error at the first non-finite loss or gradient norm (the default; "
                                      "under --fp16 a non-finite gradient only skips the step)")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false", help="count non-finite iterations instead of stopping")
    g.add_argument("--seed", type=int, default=1234, help="random seed (initialisation, dropout, data order)")
    g.add_argument("--enable-cuda-graph", action="store_true",
                   help="capture the whole training iteration in one CUDA graph and replay it (one GPU)")
    g.add_argument("--cuda-graph-scope", default="full_iteration", choices=["full_iteration"],
                   help="what the CUDA graph covers (only the whole iteration)")
    g.add_argument("--cuda-graph-warmup-steps", type=int, default=3, help="eager iterations before the capture")


def _data(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="a preprocessed dataset prefix, or weights and prefixes to blend")
    g.add_argument("--split", default="969, 30, 1", help="train, valid, test proportions of the documents")
    g.add_argument("--data-cache-path", default=None, help="folder for the cached sample indices")
    g.add_argument("--mock-data", action="store_true",
                   help="train on synthetic random tokens instead of --data-path (benchmarks, smoke tests)")
    g.add_argument("--tokenizer-type", default=None,
                   help="GPT2BPETokenizer (default), BertWordPieceLowerCase, BertWordPieceCase, "
                        "HuggingFaceTokenizer, SentencePieceTokenizer, Llama2Tokenizer or NullTokenizer (ids in, "
                        "ids out; needs --vocab-size)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer: ids 0..N-1, end-of-document id N (N + 1 ids before padding)")
    g.add_argument("--vocab-file", default=None, help="tokenizer vocabulary file")
    g.add_argument("--merge-file", default=None, help="BPE merges file (GPT2BPETokenizer)")
    g.add_argument("--tokenizer-model", default=None,
                   help="tokenizer.json or its folder (HuggingFaceTokenizer); a SentencePiece .model "
                        "(SentencePieceTokenizer, Llama2Tokenizer)")
    g.add_argument("--num-workers", type=int, default=2, help="data-loader worker processes per rank")
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on end-of-document tokens")


def _logging(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100, help="print the iteration line every N iterations")
    g.add_argument("--log-throughput", action="store_true", help="add TFLOP/s and tokens/s to the iteration line")
    g.add_argument("--tensorboard-dir", default=None, help="write TensorBoard scalars here")
    g.add_argument("--tensorboard-log-interval", type=int, default=1, help="write scalars every N iterations")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="scalars TensorBoard buffers before it writes to disk")
    g.add_argument("--wandb-project", default=None,
                   help="log the same scalars to Weights & Biases in this project (needs the wandb package; "
                        "WANDB_MODE=offline works without network)")
    g.add_argument("--wandb-exp-name", default=None, help="the Weights & Biases run name")
    g.add_argument("--wandb-save-dir", default=None, help="folder for the local Weights & Biases files")
    g.add_argument("--wandb-entity", default=None, help="the Weights & Biases team or user")


def _checkpointing(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", default=None, help="folder to save checkpoints in")
    g.add_argument("--load", default=None, help="folder to resume from (its latest checkpoint)")
    g.add_argument("--save-interval", type=int, default=None, help="save every N iterations")
    g.add_argument("--no-save-optim", action="store_true", help="save the model without optimizer state")
    g.add_argument("--no-save-rng", action="store_true", help="save without the RNG states")
    g.add_argument("--no-load-optim", action="store_true", help="do not restore the optimizer state")
    g.add_argument("--no-load-rng", action="store_true", help="do not restore the RNG states")
    g.add_argument("--finetune", action="store_true",
                   help="load only the weights and start at iteration 0 (no optimizer, scheduler or RNG state)")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model-shape flags left off the command line from the --load checkpoint")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="stop with an error when --load holds no checkpoint (instead of starting from scratch)")
    g.add_argument("--ckpt-format", default="torch",
                   help="what --save writes: torch (the --ckpt-layout files) or torch_dist (Megatron-LM's "
                        "distributed checkpoint, which Megatron-LM resumes; runs of TP=1, PP=1); --load reads both")
    g.add_argument("--ckpt-layout", choices=("ours", "megatron"), default="ours",
                   help="what --save writes: ours (plain types, loads with weights_only=True) or megatron "
                        "(Megatron-LM's legacy --ckpt-format torch files, which Megatron-LM can resume); --load "
                        "reads both")
    g.add_argument("--ckpt-fallback-on-corruption", action="store_true",
                   help="when a file of the checkpoint to load does not match its recorded sha256, load the newest "
                        "older intact checkpoint instead of stopping")
    g.add_argument("--keep-last-checkpoints", type=int, default=None, metavar="N",
                   help="after each save, delete all but the newest N checkpoint folders (default: keep all)")


def _parallel(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="tensor-parallel ranks")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="pipeline stages")
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="model chunks per pipeline stage (interleaved 1F1B)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="layers per model chunk (instead of --virtual-pipeline-model-parallel-size)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="layers on the first pipeline stage (the rest split evenly)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers on the last pipeline stage (the rest split evenly)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split LayerNorm/dropout regions along the sequence over the tensor-parallel ranks")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                   help="process-group backend (default nccl with GPUs, gloo without)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10,
                   help="a collective waiting longer than this ends the job, naming the rank that stopped "
                        "responding (fractions allowed, e.g. 0.5)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="reduce gradient buckets while the backward pass runs")
    g.add_argument("--ddp-bucket-size", type=int, default=None, help="elements per gradient-reduction bucket")
    g.add_argument("--local-rank-from-launcher", type=int, default=None, help=argparse.SUPPRESS)


def _recompute_and_kernels(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("recomputation and kernels")
    g.add_argument("--recompute-activations", action="store_true", help="same as --recompute-granularity selective")
    g.add_argument("--recompute-granularity", default=None, choices=["selective", "full"],
                   help="selective: recompute parts of each layer in backward; full: whole layers")
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"],
                   help="full: recompute groups of layers (uniform) or the first layers of each stage (block)")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="full: layers per recomputed group (uniform) or recomputed layers per stage (block); "
                        "selective: recompute only in the first N layers of each stage (default all)")
    g.add_argument("--recompute-modules", nargs="+", default=["core_attn", "mlp_act"],
                   choices=["core_attn", "mlp_act"],
                   help="what --recompute-granularity selective recomputes: the attention core and/or the MLP's "
                        "GeLU output (default both)")
    g.add_argument("--use-torch-compile", action="store_true", help="torch.compile each transformer layer")
    g.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false",
                   help="compute bias + GeLU with plain PyTorch instead of the fused kernel")
    g.add_argument("--no-bias-dropout-fusion", dest="bias_dropout_fusion", action="store_false",
                   help="compute bias + dropout + residual with plain PyTorch instead of the fused kernel")
    g.add_argument("--no-persist-layer-norm", dest="persist_layer_norm", action="store_false",
                   help="compute LayerNorm with plain PyTorch instead of the fused kernel")
    g.add_argument("--no-masked-softmax-fusion", action="store_true",
                   help="use the explicit scale-mask-softmax attention (same as --attention-backend unfused)")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="fused vocab-parallel cross entropy (no full-size logits gradient kept)")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false",
                   help="write weight gradients to .grad and add them to the fp32 buffer afterwards")


def _downstream_eval(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("zero-shot evaluation during training")
    g.add_argument("--eval-tasks", default=None, metavar="TASKS",
                   help="comma-separated zero-shot tasks scored on the model at every --eval-interval and at the "
                        "end, next to the validation loss: lambada (last-word accuracy), wikitext (perplexity)")
    g.add_argument("--eval-lambada-data", default=None, metavar="FILE",
                   help="--eval-tasks lambada: the passages, one {\"text\": ...} JSON object per line")
    g.add_argument("--eval-wikitext-data", default=None, metavar="FILE",
                   help="--eval-tasks wikitext: the raw WikiText file (e.g. wiki.test.tokens)")
    g.add_argument("--eval-strict-lambada", action="store_true",
                   help="--eval-tasks lambada: require every token of the whole last word, not only the last token")
    g.add_argument("--eval-overlapping-eval", type=int, default=None, metavar="N",
                   help="--eval-tasks wikitext: windows start every N tokens and only their last N targets count "
                        "(default --seq-length: no overlap)")
    g.add_argument("--eval-tasks-max-examples", type=int, default=None, metavar="N",
                   help="score only the first N LAMBADA passages and the first N WikiText windows (default all)")


def build_parser(p: argparse.ArgumentParser) -> None:
    for add in (_model, _parallel, _precision, _optimizer, _training, _data, _checkpointing, _logging,
                _recompute_and_kernels, _downstream_eval):
        add(p)
