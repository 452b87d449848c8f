"""Where every Megatron-LM flag stands here: implemented, translated, accepted without effect, or refused.

The parser (``arguments.py``) defines the implemented flags. This module holds the other three classes and
rewrites a command line before the parser sees it: translated flags become today's spelling (with a note), flags
without effect are dropped (with a note saying why), refused flags end the run with one line naming the feature
and what to use instead. ``classify`` puts each of Megatron's flags (``megatron_flags.py``) in exactly one class.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from megatron.training.megatron_flags import MEGATRON_FLAGS

IMPLEMENTED, TRANSLATED, NO_EFFECT, REFUSED = "implemented", "translated", "accepted without effect", "refused"


class SharedError(ValueError):
    """An error every rank raises with the same message: only rank 0 prints it."""


class ConfigError(SharedError):
    """A command-line or configuration error (found identically on every rank before any communication)."""


@dataclass(frozen=True)
class Translation:
    takes_value: bool
    rewrite: Callable[[Optional[str]], List[str]]  # the value (None for a switch) -> today's tokens
    modern: str  # what the note names as today's spelling


def _to(*flags: str) -> Callable[[Optional[str]], List[str]]:
    """Rewrite to ``flags`` followed by the value, if the old flag took one."""
    return lambda value: list(flags) + ([value] if value is not None else [])


def _only_mmap(flag: str) -> Callable[[Optional[str]], List[str]]:
    def rewrite(value):
        if value != "mmap":
            raise ConfigError(f"{flag} {value}: only the memory-mapped .bin/.idx format ('mmap') exists here; "
                              "rebuild the data with tools/preprocess_data.py")
        return []
    return rewrite


TRANSLATED_FLAGS: Dict[str, Translation] = {
    "--checkpoint-activations": Translation(False, _to("--recompute-granularity", "full", "--recompute-method",
                                                       "uniform"),
                                            "--recompute-granularity full --recompute-method uniform"),
    "--checkpoint-num-layers": Translation(True, _to("--recompute-num-layers"), "--recompute-num-layers"),
    "--activations-checkpoint-method": Translation(True, _to("--recompute-granularity", "full", "--recompute-method"),
                                                   "--recompute-granularity full --recompute-method"),
    "--activations-checkpoint-num-layers": Translation(True, _to("--recompute-num-layers"), "--recompute-num-layers"),
    "--checkpoint-granularity": Translation(True, _to("--recompute-granularity"), "--recompute-granularity"),
    "--checkpoint-method": Translation(True, _to("--recompute-method"), "--recompute-method"),
    "--recompute": Translation(False, _to("--recompute-activations"), "--recompute-activations"),
    "--data-impl": Translation(True, _only_mmap("--data-impl"), "(nothing: mmap is the only format)"),
    "--dataset-impl": Translation(True, _only_mmap("--dataset-impl"), "(nothing: mmap is the only format)"),
    "--layernorm-epsilon": Translation(True, _to("--norm-epsilon"), "--norm-epsilon"),
    "--model-parallel-size": Translation(True, _to("--tensor-model-parallel-size"), "--tensor-model-parallel-size"),
    "--intra-layer-model-parallel-size": Translation(True, _to("--tensor-model-parallel-size"),
                                                     "--tensor-model-parallel-size"),
    "--inter-layer-model-parallel-size": Translation(True, _to("--pipeline-model-parallel-size"),
                                                     "--pipeline-model-parallel-size"),
    "--batch-size": Translation(True, _to("--micro-batch-size"), "--micro-batch-size"),
    "--warmup": Translation(True, _to("--lr-warmup-fraction"), "--lr-warmup-fraction"),
    "--lr-warmup-percent": Translation(True, _to("--lr-warmup-fraction"), "--lr-warmup-fraction"),
    "--no-scaled-masked-softmax-fusion": Translation(False, _to("--no-masked-softmax-fusion"),
                                                     "--no-masked-softmax-fusion"),
    "--fp8-e4m3": Translation(False, _to("--fp8-format", "e4m3"), "--fp8-format e4m3"),
    "--fp8-hybrid": Translation(False, _to("--fp8-format", "hybrid"), "--fp8-format hybrid"),
    "--use-rotary-position-embeddings": Translation(False, _to("--position-embedding-type", "rope"),
                                                    "--position-embedding-type rope"),
    "--no-position-embedding": Translation(False, _to("--position-embedding-type", "none"),
                                           "--position-embedding-type none"),
    "--multi-query-attention": Translation(False, _to("--group-query-attention", "--num-query-groups", "1"),
                                           "--group-query-attention --num-query-groups 1"),
    "--end-weight-decay": Translation(True, _to("--weight-decay"), "--weight-decay (a constant weight decay)"),
    "--end-wd": Translation(True, _to("--weight-decay"), "--weight-decay (a constant weight decay)"),
    "--min-scale": Translation(True, _to("--min-loss-scale"), "--min-loss-scale"),
    # torch.distributed.launch without --use_env passes the local rank on the command line; torchrun sets
    # LOCAL_RANK, which is what the launcher code reads (the value is kept for when LOCAL_RANK is unset).
    "--local-rank": Translation(True, _to("--local-rank-from-launcher"), "the LOCAL_RANK environment variable"),
    "--local_rank": Translation(True, _to("--local-rank-from-launcher"), "the LOCAL_RANK environment variable"),
}

# flag -> (takes a value, why it changes nothing here)
NO_EFFECT_FLAGS: Dict[str, Tuple[bool, str]] = {
    "--DDP-impl": (True, "there is one data-parallel wrapper (contiguous fp32 gradient buffer, bucketed reduction)"),
    "--use-contiguous-buffers-in-ddp": (False, "gradients always live in one contiguous buffer"),
    "--no-contiguous-buffers-in-local-ddp": (False, "gradients always live in one contiguous buffer"),
    "--log-timers-to-tensorboard": (False, "there is no per-phase timer breakdown; iteration time and throughput "
                                           "are logged"),
    "--timing-log-level": (True, "there is no per-phase timer breakdown; iteration time and throughput are logged"),
    "--timing-log-option": (True, "there is no per-phase timer breakdown; iteration time and throughput are logged"),
    "--no-barrier-with-level-1-timing": (False, "there are no timers to synchronise"),
    "--use-mcore-models": (False, "models always use Megatron-Core's layout and parameter names"),
    "--use-flash-attn": (False, "attention uses PyTorch's SDPA, which picks the flash kernel where it can "
                                "(--attention-backend flash forces it)"),
    "--accumulate-allreduce-grads-in-fp32": (False, "gradients always accumulate and reduce in fp32"),
    "--log-memory-to-tensorboard": (False, "GPU memory is always written to TensorBoard"),
    "--no-log-memory-to-tensorboard": (False, "GPU memory is always written to TensorBoard"),
    "--empty-unused-memory-each-iter": (False, "the CUDA caching allocator is left alone"),
    "--use-gpu-initialization": (False, "initialisation is always layout independent (each rank draws the full "
                                        "master tensor and keeps its slice)"),
    "--distribute-recomputed-activations": (False, "recomputed activations are not split across tensor-parallel "
                                                   "ranks (memory only; results are the same)"),
    "--fp32-allreduce": (False, "gradients always accumulate and reduce in fp32"),
    "--log-validation-ppl-to-tensorboard": (False, "the validation perplexity is always written to TensorBoard"),
    "--log-batch-size-to-tensorboard": (False, "the batch size is always written to TensorBoard"),
    "--no-log-learnig-rate-to-tensorboard": (False, "the learning rate is always written to TensorBoard"),
    "--no-log-loss-scale-to-tensorboard": (False, "the loss scale is always written to TensorBoard"),
    "--async-tensor-model-parallel-allreduce": (False, "the input-gradient all-reduce is not overlapped with the "
                                                       "weight-gradient GEMM; results are the same"),
    "--async-tensor-parallel-allreduce": (False, "the input-gradient all-reduce is not overlapped with the "
                                                 "weight-gradient GEMM; results are the same"),
    "--no-async-tensor-model-parallel-allreduce": (False, "the input-gradient all-reduce is never overlapped"),
    "--use-cpu-initialization": (False, "initialisation is always layout independent (each rank draws the full "
                                        "master tensor and keeps its slice)"),
    "--scaled-masked-softmax-fusion": (False, "fusions are on by default; --no-masked-softmax-fusion turns it off"),
    "--scaled-upper-triang-masked-softmax-fusion": (False, "fusions are on by default; --no-masked-softmax-fusion "
                                                           "turns it off"),
    "--bias-gelu-fusion": (False, "fusions are on by default; --no-bias-gelu-fusion turns it off"),
    "--bias-dropout-fusion": (False, "fusions are on by default; --no-bias-dropout-fusion turns it off"),
    "--attention-softmax-in-fp32": (False, "the attention softmax always runs in fp32"),
    "--fp16-lm-cross-entropy": (False, "the cross entropy always runs in fp32"),
    "--empty-unused-memory-level": (True, "the CUDA caching allocator is left alone"),
    "--dataloader-type": (True, "samples are always read in Megatron's 'single' order (sequential, resumable)"),
    "--dataloader_type": (True, "samples are always read in Megatron's 'single' order (sequential, resumable)"),
    "--override-opt_param-scheduler": (False, "the schedule's shape always comes from this run's flags; a checkpoint "
                                              "restores only its position"),
    "--override-opt-param-scheduler": (False, "the schedule's shape always comes from this run's flags; a checkpoint "
                                              "restores only its position"),
    "--override-lr-scheduler": (False, "the schedule's shape always comes from this run's flags; a checkpoint "
                                       "restores only its position"),
    "--scatter-gather-tensors-in-pipeline": (False, "pipeline activations are sent whole"),
    "--no-scatter-gather-tensors-in-pipeline": (False, "pipeline activations are sent whole"),
    "--overlap-p2p-communication": (False, "pipeline sends and receives are not overlapped with compute"),
    "--no-overlap-p2p-communication": (False, "pipeline sends and receives are not overlapped with compute"),
    "--deallocate-pipeline-outputs": (False, "sent pipeline outputs are freed by autograd as usual"),
    "--distribute-saved-activations": (False, "recomputed activations are not split across tensor-parallel ranks "
                                              "(memory only; results are the same)"),
    "--distribute-checkpointed-activations": (False, "recomputed activations are not split across tensor-parallel "
                                                     "ranks (memory only; results are the same)"),
    "--manual-gc": (False, "Python's garbage collector is left on"),
    "--manual-gc-interval": (True, "Python's garbage collector is left on"),
    "--no-manual-gc-eval": (False, "Python's garbage collector is left on"),
    "--no-one-logger": (False, "there is no One Logger integration"),
    "--log-params-norm": (False, "the parameter norm is not computed; the gradient norm is logged"),
    "--log-num-zeros-in-grad": (False, "zeros in the gradient are not counted"),
    "--log-world-size-to-tensorboard": (False, "the world size is printed at start-up"),
    "--no-save-optim-state": (False, "use --no-save-optim"),
    "--mmap-warmup": (False, "the index is memory-mapped lazily"),
    "--no-mmap-bin-files": (False, "the .bin file is always memory-mapped"),
    "--use-tp-pp-dp-mapping": (False, "ranks are always ordered TP innermost, then DP, then PP"),
    "--no-clone-scatter-output-in-embedding": (False, "the embedding's scattered output is not cloned"),
}

# Flags named one by one: flag -> (feature, what to use instead)
REFUSED_FLAGS: Dict[str, Tuple[str, str]] = {
    "--num-experts": ("mixture of experts", "a dense MLP (--ffn-hidden-size)"),
    "--context-parallel-size": ("context parallelism", "--sequence-parallel with --tensor-model-parallel-size"),
    "--rampup-batch-size": ("batch-size ramp-up", "a fixed --global-batch-size"),
    "--reset-position-ids": ("per-document position ids", "positions over the whole sequence (the default)"),
    "--reset-attention-mask": ("per-document attention masks", "causal attention over the whole sequence"),
    "--train-data-path": ("separate train/valid/test data paths", "--data-path with --split"),
    "--valid-data-path": ("separate train/valid/test data paths", "--data-path with --split"),
    "--test-data-path": ("separate train/valid/test data paths", "--data-path with --split"),
    "--train-data": ("separate train/valid/test data paths", "--data-path with --split"),
    "--valid-data": ("separate train/valid/test data paths", "--data-path with --split"),
    "--test-data": ("separate train/valid/test data paths", "--data-path with --split"),
    "--fp8-param-gather": ("FP8 parameter all-gather", "--fp8-format with bf16 parameters"),
    "--use-dist-ckpt": ("distributed (torch_dist) checkpoints", "the per-rank torch checkpoints (the default)"),
    "--lr-warmup-samples": ("sample-based warm-up", "--lr-warmup-iters or --lr-warmup-fraction"),
    "--lr-decay-samples": ("sample-based decay", "--lr-decay-iters"),
    "--lr-warmup-init": ("a non-zero initial warm-up learning rate", "warm-up from 0 (--lr-warmup-iters)"),
    "--start-weight-decay": ("a weight-decay schedule", "a constant --weight-decay"),
    "--start-wd": ("a weight-decay schedule", "a constant --weight-decay"),
    "--wd-incr-style": ("a weight-decay schedule", "a constant --weight-decay"),
    "--save-retain-interval": ("deleting checkpoints except those at a retain interval",
                               "--keep-last-checkpoints N (keep the newest N)"),
    "--fp32-layernorm": ("fp32 LayerNorm weights in a 16-bit model", "--bf16 (or fp32 throughout)"),
    "--fp32-embedding": ("fp32 embedding weights in a 16-bit model", "--bf16 (or fp32 throughout)"),
    "--fp32-tokentypes": ("fp32 token-type embeddings in a 16-bit model", "--bf16 (or fp32 throughout)"),
    "--embedding-weights-in-fp32": ("fp32 embedding weights in a 16-bit model", "--bf16 (or fp32 throughout)"),
    "--weight-decay-incr-style": ("a weight-decay schedule", "a constant --weight-decay"),
    "--use-checkpoint-opt_param-scheduler": ("taking the schedule from the checkpoint",
                                             "the saved run's --lr/--min-lr/--lr-*-iters flags"),
    "--use-checkpoint-opt-param-scheduler": ("taking the schedule from the checkpoint",
                                             "the saved run's --lr/--min-lr/--lr-*-iters flags"),
    "--use-checkpoint-lr-scheduler": ("taking the schedule from the checkpoint",
                                      "the saved run's --lr/--min-lr/--lr-*-iters flags"),
    "--use-legacy-models": ("the legacy model classes", "the default models (Megatron-Core layout)"),
    "--fp32-residual-connection": ("an fp32 residual stream", "--bf16 or --fp16 (residuals in the model dtype)"),
    "--apply-residual-connection-post-layernorm": ("post-LayerNorm residuals", "pre-LayerNorm (the default)"),
    "--apply-query-key-layer-scaling": ("query-key layer scaling", "the default fp32 softmax"),
    "--no-query-key-layer-scaling": ("query-key layer scaling", "the default fp32 softmax"),
    "--padded-vocab-size": ("a given padded vocabulary", "--make-vocab-size-divisible-by"),
    "--no-initialization": ("skipping initialisation", "--load (weights come from the checkpoint)"),
}

# Whole features, by the flags' leading words: (prefixes, feature, what to use instead)
REFUSED_GROUPS: Sequence[Tuple[Tuple[str, ...], str, str]] = (
    (("--moe-", "--expert-", "--num-experts"), "mixture of experts", "a dense MLP (--ffn-hidden-size)"),
    (("--inference-", "--flash-decode", "--enable-chunked-prefill", "--disable-chunked-prefill",
      "--num-speculative-tokens", "--nccl-all-reduce-for-prefill", "--mlp-chunks-for-prefill",
      "--decode-only-cuda-graphs", "--use-legacy-static-engine"),
     "Megatron's inference engine options", "tools/ text generation (it takes the model flags)"),
    (("--rl-", "--grpo-", "--langrl-", "--perform-rl-step", "--refit-method"), "reinforcement learning", "pretraining"),
    (("--retro-",), "RETRO retrieval models", "GPT pretraining"),
    (("--ict-", "--biencoder-", "--block-", "--retriever-", "--evidence-", "--titles-", "--embedding-path",
      "--indexer-", "--bert-load", "--query-in-block-prob", "--use-one-sent-docs", "--faiss-", "--report-topk",
      "--shared-query-context-model", "--bert-embedder-type", "--output-bert-embeddings"),
     "retrieval (ICT/REALM) models", "GPT or BERT pretraining"),
    (("--dino-", "--vision-", "--swin-", "--img-", "--patch-dim", "--num-channels", "--classes-fraction",
      "--data-per-class-fraction", "--vit-load", "--num-classes", "--mask-factor", "--mask-type"),
     "vision models", "GPT or BERT pretraining"),
    (("--mamba-", "--hybrid-", "--is-hybrid-model", "--disable-mamba-mem-eff-path"), "hybrid Mamba models",
     "the transformer models"),
    (("--fim-",), "fill-in-the-middle data", "plain --data-path datasets"),
    (("--inprocess-", "--enable-ft-package", "--calc-ft-timeouts", "--ft-", "--straggler-", "--log-straggler",
      "--disable-straggler-on-startup", "--adlr-autoresume", "--max-training-rank"),
     "in-process restart, fault-tolerance and straggler detection", "--save-interval and --exit-duration-in-mins"),
    (("--one-logger-", "--enable-one-logger", "--enable-onelogger", "--app-tag-", "--otel-", "--config-logger-dir",
      "--log-energy", "--log-device-memory-used", "--log-max-attention-logit", "--log-memory-interval",
      "--logging-level", "--log-progress", "--run-workload-inspector-server"),
     "extra logging integrations", "--tensorboard-dir or --wandb-project"),
    (("--tp-comm-", "--disable-tp-comm-", "--use-nccl-ub", "--gtp-", "--symmetric-ar-type", "--sharp-enabled-group",
      "--use-sharp", "--high-priority-stream-groups", "--nccl-communicator-config-path", "--create-all-gather-group",
      "--disable-symmetric-registration"),
     "Transformer Engine / NCCL communication tuning", "the default communication (NCCL on GPUs)"),
    (("--ckpt-", "--dist-ckpt-", "--non-persistent-", "--async-save", "--auto-detect-ckpt-format",
      "--use-persistent-ckpt-worker", "--persistent-save-interval",
      "--load-model-opt-format", "--load-main-params-from-ckpt", "--use-mp-args-from-checkpoint-args",
      "--override-checkpoint-version", "--override-ckpt-iteration", "--validate-model-load", "--pretrained-checkpoint",
      "--exit-on-missing-checkpoint-args", "--disable-msc", "--enable-msc", "--object-storage-cache-path",
      "--s3-cache-path", "--dump-param-to-param-group-map", "--no-strict-fsdp-dtensor-load"),
     "other checkpoint formats and options", "--save/--load (per-rank torch checkpoints)"),
    (("--fp4-", "--first-last-layers-bf16", "--num-layers-at-", "--fp8-interval", "--fp8-quantizer-factory",
      "--no-fp8-wgrad", "--keep-fp8-transpose-cache", "--te-precision-config-file", "--reuse-grad-buf-for-mxfp8"),
     "other low-precision recipes", "--fp8-format with --fp8-recipe"),
    (("--muon-", "--lion-"), "the Muon and Lion optimizers", "--optimizer adam or sgd"),
    (("--kitchen-", "--use-kitchen-"), "the Kitchen quantisation library", "--fp8-format"),
    (("--yarn-", "--rope-type", "--rotary-scaling-factor", "--mrope-", "--no-rope-", "--mscale"),
     "other rotary position embedding variants (YaRN, multimodal RoPE)",
     "--position-embedding-type rope with --rotary-base, --rotary-percent, --use-rope-scaling"),
    (("--fsdp-", "--megatron-fsdp-", "--use-torch-fsdp2", "--use-custom-fsdp", "--use-megatron-fsdp",
      "--torch-fsdp2-", "--data-parallel-sharding-strategy", "--outer-dp-sharding-strategy",
      "--enable-full-sharding-in-hsdp", "--init-model-with-meta-device", "--suggested-communication-unit-size"),
     "fully sharded data parallelism (FSDP)", "--use-distributed-optimizer"),
    (("--mtp-",), "multi-token prediction", "next-token prediction"),
    (("--dsa-", "--linear-", "--window-", "--softmax-type", "--attention-output-gate", "--experimental-attention-variant",
      "--qk-head-dim", "--qk-l2-norm", "--qk-pos-emb-head-dim", "--qk-clip", "--q-lora-rank", "--kv-lora-rank",
      "--v-head-dim", "--multi-latent-attention", "--cache-mla-latents",
      "--mla-", "--relative-attention-", "--use-kitchen-attention"),
     "attention variants", "multi-head causal attention (the default)"),
    (("--logits-",), "logit distillation", "plain pretraining"),
    (("--profile", "--use-pytorch-profiler", "--record-memory-history", "--memory-snapshot-path"),
     "built-in profiling hooks", "torch.profiler around the run (see bench/)"),
    (("--tokenizer-hf-", "--tiktoken-", "--null-tokenizer-", "--tokenizer-special-tokens", "--tokenizer-metadata",
      "--tokenizer-path", "--legacy-tokenizer", "--tokenizer-sentencepiece-legacy", "--trust-remote-code",
      "--vocab-extra-ids", "--no-use-tokenizer-model-from-checkpoint-args", "--sft-tokenizer-prompt-format",
      "--tokenizer-model-type"),
     "other tokenizer options", "--tokenizer-type with --vocab-file/--merge-file or --tokenizer-model"),
    (("--sft",), "supervised fine-tuning", "--finetune with pretraining data"),
    (("--cp-", "--hierarchical-context-parallel-sizes", "--hybrid-context-parallel", "--max-seqlen-per-"),
     "context parallelism", "--sequence-parallel"),
    (("--encoder-", "--decoder-num-layers", "--decoder-seq-length", "--standalone-embed", "--pipeline-model-parallel-split-rank"),
     "encoder-decoder models and split pipelines", "--num-layers with --decoder-first/last-pipeline-num-layers"),
    (("--heterogeneous-layers-config-", "--num-unique-layers", "--param-sharing-style", "--spec", "--model-spec",
      "--yaml-cfg", "--pipeline-model-parallel-layout", "--account-for-", "--num-virtual-stages-per-pipeline-rank",
      "--microbatch-group-size-per-virtual-pipeline-stage", "--pipeline-model-parallel-comm-backend"),
     "custom layer specifications and pipeline layouts", "--num-layers with --virtual-pipeline-model-parallel-size"),
    (("--rerun-", "--error-injection-", "--result-rejected-tracker-filename", "--check-for-large-grads",
      "--check-for-spiky-loss", "--check-weight-hash-across-dp-replicas-interval"),
     "result validation and error injection", "--check-for-nan-in-loss-and-grad"),
    (("--num-distributed-optimizer-instances", "--use-precision-aware-optimizer", "--main-grads-dtype",
      "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype", "--optimizer-cpu-offload",
      "--optimizer-offload-fraction", "--overlap-cpu-optimizer-d2h-h2d", "--use-torch-optimizer-for-cpu-offload",
      "--optimizer-cuda-graph", "--pin-cpu-", "--no-pin-cpu-", "--distrib-optim", "--disrib-opt", "--distrib-opt",
      "--dist-ckpt-optim"),
     "optimizer precision and offloading options", "--use-distributed-optimizer (fp32 main weights and states)"),
    (("--ddp-", "--no-align-grad-reduce", "--no-align-param-gather", "--align-param-gather", "--delay-param-gather",
      "--no-delay-grad-reduce", "--overlap-param-gather-with-optimizer-step", "--delay-wgrad-compute",
      "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "--grad-reduce-in-bf16", "--no-gradient-reduce-div",
      "--no-data-sharding", "--disable-gloo-process-groups", "--fake-process-group", "--distributed-timeout-seconds",
      "--lazy-mpu-init", "--use-ring-exchange-p2p", "--use-pipelining", "--initialize-socket-comms",
      "--tp-comm-bootstrap-backend"),
     "data-parallel and communication tuning", "--overlap-grad-reduce, --overlap-param-gather, --ddp-bucket-size"),
    (("--cpu-offloading", "--offload-modules", "--fine-grained-activation-offloading", "--min-offloaded-tensor-size"),
     "activation offloading", "--recompute-granularity"),
    (("--squared-relu", "--quick-geglu", "--openai-gelu", "--erf-gelu", "--use-fused-weighted-squared-relu",
      "--glu-linear-offset", "--activation-func-clamp-value", "--bias-swiglu-fusion", "--no-bias-swiglu-fusion",
      "--use-te-activation-func", "--onnx-safe"),
     "other activation functions", "the GeLU MLP (the default)"),
    (("--decoupled-", "--head-lr-mult", "--apply-wd-to-qk-layernorm", "--no-weight-decay-cond-type",
      "--lr-wsd-", "--phase-transition-iterations"),
     "per-group learning rates and other schedules", "--lr-decay-style constant, linear or cosine"),
    (("--mask-prob", "--short-seq-prob", "--max-preds-per-seq", "--bert-no-binary-head", "--pretrained-bert",
      "--use-random-spans", "--use-regular-masking", "--allow-trivial-doc", "--allow-ambiguous-pad-tokens"),
     "BERT and T5 pretraining options in the GPT trainer", "pretrain_gpt.py's flags"),
    (("--eval-hf", "--eval-max-preds-per-seq", "--eval-seq-length", "--greedy", "--temperature", "--top_k",
      "--top_p", "--out-seq-length", "--sample-input-file", "--sample-output-file", "--genfile", "--num-samples",
      "--load-openai", "--cloze-eval", "--strict-lambada", "--overlapping-eval", "--test-mode", "--cased-",
      "--ner-data-path", "--max-tokens-to-oom", "--max-num-samples", "--use-same-sampling-seed-across-dp-ranks"),
     "Megatron-LM's text-generation and task options in the trainer",
     "tools/generate.py, tasks/main.py, or --eval-tasks (with --eval-strict-lambada, --eval-overlapping-eval)"),
    (("--cuda-graph-impl", "--cuda-graph-modules", "--external-cuda-graph", "--enable-cuda-graph-",
      "--rl-training-cuda-graphs", "--inference-cuda-graph"),
     "other CUDA-graph modes", "--enable-cuda-graph (the whole iteration)"),
    (("--data-args-path", "--per-split-data-args-path", "--data-cache-", "--multiple-validation-sets",
      "--full-validation", "--renormalize-blend-weights", "--mid-level-dataset-surplus", "--num-dataset-builder-threads",
      "--per-dataset-sequences-path", "--dataloader-", "--no-create-attention-mask-in-dataloader",
      "--data-epochs", "--iter-per-epoch", "--hash-data-path", "--input-data-sizes-file", "--data-loader",
      "--sample-rate", "--train-sync-interval", "--iterations-to-skip", "--calculate-per-token-loss",
      "--decrease-batch-size-if-needed", "--num-microbatches", "--eval-batch-size", "--cache-dir",
      "--presplit-sentences", "--loose-json", "--text-key", "--eval-text-key", "--shuffle"),
     "other data-pipeline options", "--data-path with --split (and --data-cache-path)"),
)

# Everything else Megatron-LM defined is refused with this feature and advice.
REFUSED_OTHER = ("a Megatron-LM option this framework does not implement", "the flags listed in docs/flags.md")

# Implemented flags whose default differs from Megatron-LM's, and why.
DEFAULT_DIFFERENCES: Dict[str, str] = {
    "--distributed-backend": "Megatron-LM: nccl; here nccl on GPUs and gloo on CPU-only machines",
    "--recompute-modules": "Megatron-LM: core_attn; here also mlp_act (the GeLU output is cheap to recompute)",
    "--ckpt-format": "Megatron-LM: torch_dist; here torch (torch_dist for runs of TP=1, PP=1)",
    "--split": "Megatron-LM (2024 on): none; here 969, 30, 1 (Megatron-LM's older default)",
    "--tokenizer-type": "Megatron-LM: none (required); here GPT2BPETokenizer",
    "--fp8-recipe": "Megatron-LM: delayed; here tensorwise (current scaling needs no history to be right)",
    "--transformer-impl": "Megatron-LM: transformer_engine; here local, the only implementation",
    "--no-persist-layer-norm": "Megatron-LM: the non-persistent fused kernel; here the plain PyTorch LayerNorm "
                               "(there is one fused LayerNorm kernel)",
}


def refused_reason(flag: str) -> Tuple[str, str]:
    """(feature, advice) for a refused Megatron flag."""
    if flag in REFUSED_FLAGS:
        return REFUSED_FLAGS[flag]
    for prefixes, feature, advice in REFUSED_GROUPS:
        if flag.startswith(prefixes):
            return feature, advice
    return REFUSED_OTHER


def classify(flag: str, implemented: Iterable[str]) -> str:
    """The class of ``flag`` (one of the four constants above), for a Megatron-LM flag."""
    if flag in set(implemented):
        return IMPLEMENTED
    if flag in TRANSLATED_FLAGS:
        return TRANSLATED
    if flag in NO_EFFECT_FLAGS:
        return NO_EFFECT
    return REFUSED


def closest(flag: str, known: Iterable[str], n: int = 3) -> List[str]:
    return difflib.get_close_matches(flag, sorted(known), n=n, cutoff=0.75)


def rewrite_argv(argv: Sequence[str], implemented: Iterable[str]) -> Tuple[List[str], List[str]]:
    """Translate, drop or refuse Megatron-LM flags; returns (argv for the parser, notes to print on rank 0).

    Flags the parser implements and unknown non-Megatron flags pass through (the parser reports the latter).
    """
    implemented = set(implemented)
    megatron = set(MEGATRON_FLAGS)
    out: List[str] = []
    notes: List[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        flag, eq, inline = tok.partition("=")
        if not tok.startswith("--") or flag in implemented:
            out.append(tok)
            continue

        def value() -> str:
            nonlocal i
            if eq:
                return inline
            if i >= len(argv) or argv[i].startswith("--"):
                raise ConfigError(f"{flag} expects a value")
            i += 1
            return argv[i - 1]

        if flag in TRANSLATED_FLAGS:
            tr = TRANSLATED_FLAGS[flag]
            v = value() if tr.takes_value else None
            new = tr.rewrite(v)
            out.extend(new)
            shown = f"{flag} {v}" if v is not None else flag
            modern = tr.modern if flag in ("--local-rank", "--local_rank") else (" ".join(new) or tr.modern)
            notes.append(f"note: {shown} is an older spelling; using {modern}")
        elif flag in NO_EFFECT_FLAGS:
            takes, why = NO_EFFECT_FLAGS[flag]
            shown = f"{flag} {value()}" if takes else flag
            notes.append(f"note: {shown} has no effect here: {why}")
        elif flag in megatron:
            feature, advice = refused_reason(flag)
            raise ConfigError(f"{flag} is a Megatron-LM flag for {feature}, which this framework does not "
                              f"implement; use {advice}")
        else:
            out.append(tok)
    return out, notes
