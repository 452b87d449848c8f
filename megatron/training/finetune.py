"""BERT fine-tuning on MNLI, QQP and RACE (``tasks/main.py --task MNLI|QQP|RACE``), on the trainer's machinery.

The run is the trainer's: the same flags, optimizer, scheduler, data-parallel wrapper, pipeline schedules,
checkpoints, iteration line and exit handling (``Trainer``). What fine-tuning adds (the ``finetune`` section):

- ``--train-data`` / ``--valid-data`` (several files each) read as the task's layout (``finetune_data.py``);
- ``--epochs``: ``--train-iters`` is ``epochs x (training examples // global batch)``; each epoch visits the
  examples in a new order (seeded by ``--seed`` and the epoch), the last incomplete global batch left out;
- ``--pretrained-checkpoint``: the weights to start from (ours or Megatron-LM's, any TP/PP; a Hugging Face BERT
  after ``tools/checkpoint/convert.py``); the model flags left out come from its arguments and those given must
  agree with it. The pre-training heads are dropped; the classification head (and the pooler and token-type
  embedding when the checkpoint has none) start from the layout-independent initialisation. ``--load`` with a
  checkpoint resumes a fine-tuning run instead;
- validation: the accuracy on every ``--valid-data`` file, printed as Megatron-LM did
  (`` > |epoch: E| metrics for FILE: correct / total = N / M = P %``), at every ``--eval-interval`` and after each
  epoch; with ``--save`` a checkpoint after each epoch, and the best epoch's (by accuracy over all validation
  files) also in ``SAVE/best``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.datasets.finetune_data import TASKS, FinetuneDataError, build_dataset, read_examples
from megatron.core.models.bert_heads import PRETRAINING_HEADS, BertFinetuneModel
from megatron.training import checkpointing
from megatron.training.bert_chunks import build_bert_chunks
from megatron.training.config import ExtraSection
from megatron.training.flag_table import ConfigError, SharedError
from megatron.training.setup import (build_context, build_model, job_environment, load_checkpoint_if_any,
                                     print_rank_0, print_rank_last)
from megatron.training.training import Trainer

# model flags a pre-trained checkpoint decides: filled from its arguments when left out, checked when given
CHECKPOINT_MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                          "max_position_embeddings", "make_vocab_size_divisible_by", "norm_epsilon",
                          "apply_layernorm_1p", "untie_embeddings_and_output_weights")


@dataclass(frozen=True)
class FinetuneConfig:
    task: str
    train_data: Tuple[str, ...]
    valid_data: Tuple[str, ...]
    pretrained_checkpoint: Optional[str]
    epochs: int
    apply_residual_connection_post_layernorm: bool
    train_examples: int  # derived: the examples of --train-data


def add_finetune_arguments(parser) -> None:
    g = parser.add_argument_group("fine-tuning")
    g.add_argument("--task", required=True, choices=sorted(TASKS), help="MNLI, QQP or RACE")
    g.add_argument("--train-data", nargs="+", default=None, help="training files (RACE: passage folders)")
    g.add_argument("--valid-data", nargs="+", default=None, help="validation files, each scored on its own")
    g.add_argument("--pretrained-checkpoint", default=None,
                   help="checkpoint folder to start from (ours or Megatron-LM's, any TP/PP)")
    g.add_argument("--epochs", type=int, default=None, help="passes over --train-data (sets --train-iters)")
    g.add_argument("--apply-residual-connection-post-layernorm", action="store_true", default=None,
                   help="post-LN BERT (default: the pre-trained checkpoint's order, else pre-LN)")
    parser.set_defaults(train_examples=0)


def _fill_from_pretrained(ns) -> None:
    try:
        saved = checkpointing.read_saved_args(ns.pretrained_checkpoint)
    except checkpointing.CheckpointError as exc:
        raise ConfigError(f"--pretrained-checkpoint: {exc}") from None
    if saved.get("norm_epsilon") is None and saved.get("layernorm_epsilon") is not None:
        saved["norm_epsilon"] = saved["layernorm_epsilon"]
    for name in CHECKPOINT_MODEL_FLAGS + ("apply_residual_connection_post_layernorm",):
        have, want = getattr(ns, name), saved.get(name)
        if want is None:
            continue
        if have is None:
            setattr(ns, name, want)
        elif have != want and not (isinstance(want, float) and abs(have - want) <= 1e-12 * max(1.0, abs(want))):
            raise ConfigError(f"--{name.replace('_', '-')} {have} differs from the pre-trained checkpoint's {want} "
                              f"(--pretrained-checkpoint {ns.pretrained_checkpoint}); leave it out to use the "
                              "checkpoint's")
    if ns.tokenizer_type is None and saved.get("tokenizer_type"):
        ns.tokenizer_type = saved["tokenizer_type"]
    if ns.vocab_file is None and saved.get("vocab_file") and os.path.isfile(saved["vocab_file"]):
        ns.vocab_file = saved["vocab_file"]


def prepare_finetune(ns, world_size: int) -> None:
    """Before the trainer's validation: model flags from the pre-trained checkpoint, --train-iters from
    --epochs, and the training files as the run's data."""
    for flag in ("train_data", "valid_data", "epochs"):
        if getattr(ns, flag) is None:
            raise ConfigError(f"--{flag.replace('_', '-')} is required for fine-tuning")
    if ns.epochs < 1:
        raise ConfigError(f"--epochs must be >= 1, got {ns.epochs}")
    if ns.train_iters is not None or ns.train_samples is not None:
        raise ConfigError("--train-iters and --train-samples are set by --epochs when fine-tuning; leave them out")
    if ns.pretrained_checkpoint is not None:
        if not os.path.isdir(ns.pretrained_checkpoint):
            raise ConfigError(f"--pretrained-checkpoint {ns.pretrained_checkpoint}: no such folder")
        _fill_from_pretrained(ns)
    if ns.tokenizer_type is None:
        ns.tokenizer_type = "BertWordPieceLowerCase"
    if ns.apply_residual_connection_post_layernorm is None:
        ns.apply_residual_connection_post_layernorm = False
    for path in list(ns.train_data) + list(ns.valid_data):
        if not os.path.exists(path):
            raise ConfigError(f"--train-data/--valid-data {path}: no such file or folder")
    try:
        ns.train_examples = len(read_examples(ns.task, ns.train_data))
    except FinetuneDataError as exc:
        raise ConfigError(f"--train-data: {exc}") from None
    tp, pp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size
    dp = max(1, world_size // max(1, tp * pp))
    gbs = ns.global_batch_size or (ns.micro_batch_size or 1) * dp
    per_epoch = ns.train_examples // gbs
    if per_epoch < 1:
        raise ConfigError(f"--train-data holds {ns.train_examples} examples, fewer than one global batch ({gbs})")
    ns.train_iters = ns.epochs * per_epoch
    ns.data_path = list(ns.train_data)  # the run's data, as the checkpoint's arguments record it


def validate_finetune(ns) -> None:
    if not ns.tokenizer_type.startswith("BertWordPiece"):
        raise ConfigError(f"fine-tuning a BERT needs a WordPiece vocabulary: --tokenizer-type must be "
                          f"BertWordPieceLowerCase or BertWordPieceCase, got {ns.tokenizer_type}")
    if ns.seq_length > ns.max_position_embeddings:
        raise ConfigError(f"--seq-length {ns.seq_length} exceeds the model's {ns.max_position_embeddings} positions "
                          "(--max-position-embeddings)")


FINETUNE = ExtraSection("finetune", FinetuneConfig, add_finetune_arguments, validate_finetune, prepare_finetune)


# ---- the model ---------------------------------------------------------------------------------------------
def model_provider(ctx) -> List[BertFinetuneModel]:
    """This rank's chunks with the task's head, initialised layout-independently."""
    ft = ctx.config.extra["finetune"]
    return build_bert_chunks(ctx, ft.apply_residual_connection_post_layernorm, lambda config, c: BertFinetuneModel(
        config, ctx.pstate, num_classes=TASKS[ft.task], multiple_choice=ft.task == "RACE",
        pre_process=c.pre_process, post_process=c.post_process, num_layers=c.num_layers,
        layer_offset=c.layer_offset, use_torch_compile=ctx.config.model.use_torch_compile))


def load_pretrained(chunks: List[torch.nn.Module], root: str, ctx) -> List[str]:
    """Load the encoder (and pooler, token types) of the checkpoint in ``root`` into this rank's chunks, resharded
    to the running layout; the pre-training heads are dropped. Returns the parameters that keep their
    initialisation."""
    from megatron.core import checkpoint_formats as formats
    from megatron.core.checkpoint_formats.load_time import checkpoint_format

    pstate = ctx.pstate
    try:
        iteration = checkpointing.read_tracker(root)
        it_dir = os.path.join(root, "release" if iteration == 0 else f"iter_{iteration:07d}")
        fmt = checkpoint_format(it_dir) if os.path.isdir(it_dir) else None
        if fmt == "ours":
            ckpt = formats.read_our_checkpoint(root, load_optim=False, load_rng=False)
        elif fmt == "megatron":
            ckpt = formats.read_megatron_checkpoint(root, formats.BERT, load_optim=False, load_rng=False)
        else:
            raise SharedError(f"--pretrained-checkpoint {root}: {it_dir} is not a checkpoint this reads (ours or "
                              "Megatron-LM's legacy torch files; convert others with tools/checkpoint/convert.py)")
        dims = formats.dims_from_args(ckpt.args_dict)
        if dims.padded_for(pstate.tp_size) != ctx.padded_vocab_size:
            dims = dataclasses.replace(dims, vocab_size=ctx.padded_vocab_size, make_vocab_size_divisible_by=1)
        vpp = len(chunks) if len(chunks) > 1 else None
        shards, _, _ = formats.state_for_rank(ckpt, dims, pstate.tp_size, pstate.pp_size, pstate.tp_rank,
                                              pstate.pp_rank, family=formats.BERT, vpp_size=vpp)
    except (formats.CheckpointFormatError, checkpointing.CheckpointError) as exc:
        raise SharedError(f"--pretrained-checkpoint {root}: {exc}") from None
    fresh = []
    for chunk, sd in zip(chunks, shards):
        sd = {k: v for k, v in sd.items() if not k.endswith("_extra_state") and not k.startswith(PRETRAINING_HEADS)}
        try:
            missing, unexpected = chunk.load_state_dict(sd, strict=False)
        except RuntimeError as exc:
            first = [line.strip() for line in str(exc).splitlines() if "size mismatch" in line] or [str(exc)]
            raise SharedError(f"--pretrained-checkpoint {root} does not fit this model: {first[0]}") from None
        if unexpected:
            raise SharedError(f"--pretrained-checkpoint {root} holds {unexpected[0]}, which this model lacks")
        new = ("pooler.", "classification_head.", "multichoice_head.", "embedding.tokentype_embeddings.")
        wrong = [k for k in missing if not k.startswith(new)]
        if wrong:
            raise SharedError(f"--pretrained-checkpoint {root} lacks {wrong[0]}")
        fresh += missing
    return fresh


# ---- data --------------------------------------------------------------------------------------------------
def _to_device(batch: dict) -> dict:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return {k: torch.from_numpy(v).to(device) for k, v in batch.items()}


def train_batches(dataset, ctx, start_iteration: int):
    """The microbatches of this data-parallel rank from ``start_iteration`` on (without end): epoch ``e`` visits
    the examples in the order of ``RandomState(seed + e)``; iteration ``i`` of an epoch takes examples
    ``[i x G, (i + 1) x G)`` of it (G the global batch), this rank the ``dp_rank``-th slice, in microbatches."""
    t, pstate = ctx.config.training, ctx.pstate
    gbs, mbs = t.global_batch_size, t.micro_batch_size
    per_epoch = len(dataset) // gbs
    it = start_iteration
    while True:
        epoch, i = divmod(it, per_epoch)
        order = np.random.RandomState(t.seed + epoch).permutation(len(dataset))
        mine = order[i * gbs:(i + 1) * gbs][pstate.dp_rank * mbs * t.num_microbatches:]
        for m in range(t.num_microbatches):
            yield _to_device(dataset.batch(mine[m * mbs:(m + 1) * mbs]))
        it += 1


def eval_batches(dataset, ctx):
    """Every example once, this data-parallel rank's share: examples ``r, r + D, ...`` in microbatches; the last
    microbatch is filled up with label -1 (not counted). Returns ``(iterator, number of microbatches)``."""
    mbs, pstate = ctx.config.training.micro_batch_size, ctx.pstate
    stride = mbs * pstate.dp_size
    n_micro = -(-len(dataset) // stride)
    idx = np.arange(n_micro * stride)
    valid = idx < len(dataset)
    idx = np.where(valid, idx, 0)
    mine, ok = idx[pstate.dp_rank::pstate.dp_size], valid[pstate.dp_rank::pstate.dp_size]

    def gen():
        for m in range(n_micro):
            batch = dataset.batch(mine[m * mbs:(m + 1) * mbs])
            batch["label"] = np.where(ok[m * mbs:(m + 1) * mbs], batch["label"], -1)
            yield _to_device(batch)
    return gen, n_micro


# ---- steps -------------------------------------------------------------------------------------------------
def cross_entropy_loss(labels: torch.Tensor, logits: torch.Tensor):
    """The mean cross-entropy of a microbatch (in fp32), reported as ``lm loss`` as Megatron-LM's fine-tuning did."""
    loss = F.cross_entropy(logits.float(), labels)
    return loss, {"lm loss": loss.detach()}


def accuracy_counts(labels: torch.Tensor, logits: torch.Tensor):
    valid = labels >= 0
    correct = ((logits.argmax(dim=-1) == labels) & valid).sum()
    zero = logits.float().sum() * 0.0
    return zero, {"correct": correct.detach().float(), "total": valid.sum().float()}


def forward_step(loss_func, data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["text"], batch["padding_mask"], tokentype_ids=batch["types"])
    return output, functools.partial(loss_func, batch["label"])


class FinetuneTrainer(Trainer):
    """The trainer whose evaluation is the accuracy on every validation file (Megatron-LM's lines)."""

    def __init__(self, *args, ctx=None, valid_sets=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.ctx, self.valid_sets = ctx, list(valid_sets)
        self.epoch = 0
        self.best: Optional[Tuple[float, int]] = None  # (accuracy %, epoch)
        self.accuracy_history: List[dict] = []

    def evaluate(self, split: str, label: str) -> Optional[dict]:
        if split != "valid" or not self.valid_sets:
            return None
        for chunk in self.model:
            chunk.eval()
        results, total_correct, total_count = {}, 0, 0
        for name, dataset in self.valid_sets:
            start = time.time()
            gen, n_micro = eval_batches(dataset, self.ctx)
            with torch.no_grad():
                stats = self.forward_backward(
                    forward_step_func=functools.partial(forward_step, accuracy_counts),
                    data_iterator=[gen() for _ in self.model], model=self.model, num_microbatches=n_micro,
                    pstate=self.pstate, **self.activation_shape, forward_only=True,
                    no_sync_func=[chunk.no_sync for chunk in self.model])
            counts = torch.zeros(2, dtype=torch.float64)
            if self.pstate.is_pipeline_last_stage:
                counts[0] = sum(float(s["correct"]) for s in stats)
                counts[1] = sum(float(s["total"]) for s in stats)
            if dist.is_initialized():
                dist.all_reduce(counts)  # DP shares add up; other stages and TP copies are counted once below
                counts /= self.pstate.tp_size  # every TP rank of a last stage holds the same counts
            correct, total = int(round(counts[0].item())), int(round(counts[1].item()))
            pct = 100.0 * correct / max(1, total)
            print_rank_last(f" > |epoch: {self.epoch}| metrics for {name}: correct / total = {correct} / {total} = "
                            f"{pct:.4f} %, elapsed time (sec): {time.time() - start:.3f}")
            results[name] = {"correct": correct, "total": total, "accuracy": pct}
            total_correct, total_count = total_correct + correct, total_count + total
        overall = 100.0 * total_correct / max(1, total_count)
        print_rank_last(f" >> |epoch: {self.epoch}| overall: correct / total = {total_correct} / {total_count} = "
                        f"{overall:.4f} %")
        for chunk in self.model:
            chunk.train()
        record = {"epoch": self.epoch, "iteration": self.iteration, "accuracy": overall, "files": results}
        self.accuracy_history.append(record)
        self.tb.scalars(self.iteration, {"validation accuracy": overall})
        return record

    def save_best(self, accuracy: float) -> None:
        """Keep the checkpoint of the best epoch so far in ``SAVE/best`` (with its accuracy in best.json)."""
        if not self.ckpt_cfg.save or (self.best is not None and accuracy <= self.best[0]):
            return
        self.best = (accuracy, self.epoch)
        best_dir = os.path.join(self.ckpt_cfg.save, "best")
        os.makedirs(best_dir, exist_ok=True)
        checkpointing.save_checkpoint(self.iteration, self.model, self.optimizer, self.scheduler,
                                      replace(self.ckpt_cfg, save=best_dir, keep_last_checkpoints=1), self.pstate,
                                      self.consumed_train_samples, self.plain_args)
        if self.pstate.rank == 0:
            with open(os.path.join(best_dir, "best.json"), "w") as f:
                json.dump({"epoch": self.epoch, "iteration": self.iteration, "accuracy": accuracy}, f, indent=1)
        print_rank_0(f"best validation accuracy so far ({accuracy:.4f} % at epoch {self.epoch}): checkpoint in "
                     f"{best_dir}")


def _datasets(ctx, ft: FinetuneConfig):
    seq = ctx.config.model.seq_length
    try:
        train = build_dataset(ft.task, ft.train_data, ctx.tokenizer, seq)
        valid = [(path, build_dataset(ft.task, [path], ctx.tokenizer, seq)) for path in ft.valid_data]
    except FinetuneDataError as exc:
        raise SharedError(str(exc)) from None
    for path, dataset in valid:
        if len(dataset) == 0:
            raise SharedError(f"--valid-data {path} holds no {ft.task} examples")
    print_rank_0(f"> {ft.task}: {len(train)} training examples, validation "
                 + ", ".join(f"{os.path.basename(p.rstrip('/'))} {len(d)}" for p, d in valid))
    return train, valid


def finetune(argv: Optional[List[str]] = None) -> dict:
    """Run a fine-tuning job; returns a summary (the iteration history and every validation result)."""
    start_time = time.time()
    with job_environment(argv, [FINETUNE]) as (cfg, pstate):
        ft, t = cfg.extra["finetune"], cfg.training
        tensor_parallel.model_parallel_seed(t.seed + 100 * pstate.pp_rank, pstate)
        ctx = build_context(cfg, pstate)
        train_set, valid_sets = _datasets(ctx, ft)
        chunks = model_provider(ctx)
        resuming = bool(cfg.checkpointing.load) and checkpointing.latest_iteration(cfg.checkpointing.load) is not None
        if ft.pretrained_checkpoint and not resuming:
            fresh = load_pretrained(chunks, ft.pretrained_checkpoint, ctx)
            print_rank_0(f"> loaded the pre-trained weights of {ft.pretrained_checkpoint}; initialised here: "
                         f"{', '.join(sorted(set(fresh))) or 'nothing'}")
        model = build_model(cfg, pstate, chunks)
        trainer = FinetuneTrainer(cfg, pstate, model, None, {}, ctx=ctx, valid_sets=valid_sets)
        if ft.task == "RACE":  # every question is four sequences in the pipeline's activations
            trainer.activation_shape["micro_batch_size"] *= TASKS["RACE"]
        trainer.iteration, trainer.consumed_train_samples = load_checkpoint_if_any(
            cfg.checkpointing, model, trainer.optimizer, trainer.scheduler, pstate)
        best_file = os.path.join(cfg.checkpointing.save or "", "best", "best.json")
        if resuming and cfg.checkpointing.save and os.path.isfile(best_file):  # the best epoch before the restart
            with open(best_file) as f:
                best = json.load(f)
            trainer.best = (float(best["accuracy"]), int(best["epoch"]))
        trainer.forward_step_func = functools.partial(forward_step, cross_entropy_loss)
        trainer.iterators = {"train": [train_batches(train_set, ctx, trainer.iteration) for _ in model]}
        per_epoch = t.train_iters // ft.epochs
        history = []
        while trainer.iteration < t.train_iters:
            trainer.epoch = trainer.iteration // per_epoch
            end = (trainer.epoch + 1) * per_epoch
            trainer.train_cfg = replace(t, train_iters=end)
            print_rank_0(f"> epoch {trainer.epoch}: iterations {trainer.iteration + 1}-{end}")
            result = trainer.run(start_time)
            history += result["history"]
            if result["exited"]:
                break
            record = trainer.evaluate("valid", "validation")
            if cfg.checkpointing.save:
                trainer.save()
                if record is not None:
                    trainer.save_best(record["accuracy"])
            trainer.epoch += 1
        trainer.train_cfg = t
        if t.skip_train or t.train_iters == 0:
            trainer.evaluate("valid", "validation")
        trainer.tb.close()
        return {"history": history, "accuracy": trainer.accuracy_history, "iteration": trainer.iteration,
                "best": trainer.best}
