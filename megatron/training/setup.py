"""Everything around the training loop: joining the job, building what the loop needs, and ending the process.

A run goes ``job_environment`` (flags -> config, process group, rank grid, heartbeat, run lock) -> ``build_context``
(tokenizer, padded vocabulary) -> ``build_model`` (the entry point's chunks, wrapped for data parallelism) ->
``build_optimizer`` / ``build_scheduler`` -> ``load_checkpoint_if_any`` -> ``build_iterators``; ``pretrain()`` in
``training.py`` strings these together around the loop. ``main_entry`` turns the errors a run may end with into
one line and an exit status. The rank helpers here (``print_rank_0``, ``job_flags``, ``rank_0_first``) are shared
by the setup and the loop.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import sys
import time
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core.distributed import DDPConfig, DistributedDataParallel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import ParallelState
from megatron.training import checkpoint_folder as cfold
from megatron.core import checkpoint_io as cio
from megatron.training import checkpointing, signals, watchdog
from megatron.training.arguments import parse_config, world_size_from_env
from megatron.training.config import (CheckpointConfig, ParallelConfig, RunConfig, SchedulerConfig,
                                      TrainingContext, pad_vocab_size)
from megatron.training.dry_run import wants_dry_run
from megatron.training.flag_table import ConfigError, SharedError
from megatron.training.run_lock import RunLockError, acquire_for_job
from megatron.training.scheduler import OptimizerParamScheduler


# ---- rank helpers ---------------------------------------------------------------------------------------------
def print_rank_0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def print_rank_last(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
        print(msg, flush=True)


def _env_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def sync_device() -> None:
    """Wait for the GPU's queued work (nothing to wait for on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def job_flags(values, dtype=torch.float32) -> torch.Tensor:
    """A small tensor of per-rank decisions for a MAX all-reduce, on the device the process group's backend
    reduces (NCCL only reduces GPU tensors)."""
    flags = torch.tensor(values, dtype=dtype)
    if dist.is_initialized() and dist.get_backend() == "nccl":
        flags = flags.to(torch.device("cuda", torch.cuda.current_device()))
    return flags


def rank_0_first(build: Callable[[bool], object]) -> object:
    """``build(True)`` on rank 0, then ``build(False)`` on the others (e.g. to read what rank 0 cached).

    An error on rank 0 (``ValueError``/``OSError``) reaches every rank as the same ``SharedError`` message,
    instead of the others failing on a closed connection.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return build(True)
    error, result = None, None
    if dist.get_rank() == 0:
        try:
            result = build(True)
        except (ValueError, OSError) as exc:
            error = str(exc)
    message = [error]
    dist.broadcast_object_list(message, src=0)
    if message[0] is not None:
        raise SharedError(message[0])
    return result if dist.get_rank() == 0 else build(False)


# ---- joining the job ------------------------------------------------------------------------------------------
def initialize_distributed(parallel: ParallelConfig) -> int:
    """Join the process group torchrun (or torch.distributed.launch) describes, with the configured backend and
    timeout; return the world size."""
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None and parallel.local_rank_from_launcher is not None:
        local_rank = str(parallel.local_rank_from_launcher)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(local_rank or "0") % torch.cuda.device_count())
    if parallel.world_size > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(minutes=parallel.distributed_timeout_minutes)
        store = restart_attempt_store(timeout)
        if store is None:
            dist.init_process_group(backend=parallel.distributed_backend, timeout=timeout)
        else:
            dist.init_process_group(backend=parallel.distributed_backend, timeout=timeout, store=store,
                                    rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    return parallel.world_size


def restart_attempt_store(timeout: datetime.timedelta):
    """Under ``torchrun``, the launcher's store seen through a prefix of this restart attempt; None elsewhere.

    ``torchrun``'s default (static) rendezvous keeps one store for all the attempts of ``--max-restarts`` and
    hands it to the ranks without a per-attempt prefix, so the ranks of a restart would read the addresses that
    the previous attempt's (dead) ranks published for each process group, and the heartbeat records of those
    ranks: joining a group then fails (``connectFullMesh ... Connection refused``) or waits out the timeout.
    Every key of this run lives under ``megatron-lite/attempt_N/`` instead.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=timeout)
    return dist.PrefixStore(f"megatron-lite/attempt_{attempt}/", client)


def check_checkpoint_folders(ck: CheckpointConfig):
    """Start-up checks of --load and --save, before any model is built: under --exit-on-missing-checkpoint a
    --load folder without a checkpoint is an error (otherwise the run starts from scratch, as on the first launch
    of a script that saves and loads the same folder); --save must be writable (every rank probes: each may write
    on its own mount) and is locked against a second run (rank 0 holds the lock until exit). Returns the lock
    (None without --save, or on ranks that do not hold it)."""
    if ck.load and ck.exit_on_missing_checkpoint and checkpointing.latest_iteration(ck.load) is None:
        why = "does not exist" if not os.path.isdir(ck.load) else "holds no checkpoint"
        raise SharedError(f"--exit-on-missing-checkpoint: the --load folder {ck.load} {why}")
    if ck.save:
        cfold.check_save_dir_writable(ck.save)
        lock = acquire_for_job(ck.save)
        if lock is not None and lock.note:
            print_rank_0(f"> {lock.note}")
        return lock
    return None


@contextlib.contextmanager
def job_environment(argv: Optional[List[str]], extra_sections: Sequence = ()) -> Iterator[Tuple[RunConfig,
                                                                                                 ParallelState]]:
    """Parse the flags and join the job for the duration of the ``with`` block; yields ``(config, pstate)``.

    On entry: the configuration (notes printed by rank 0), the --exit-signal handler (from the start, so a signal
    during start-up stops after iteration 1), the process group, the rank grid, the heartbeat and the checks and
    lock of the checkpoint folders. On exit the lock and the signal handler are released and the heartbeat stops,
    except after an error: then it beats on, so that ``main_entry`` can read the other ranks' heartbeats after a
    timeout.
    """
    cfg, notes = parse_config(argv, world_size=world_size_from_env(), extra_sections=extra_sections)
    if wants_dry_run(sys.argv[1:] if argv is None else argv):
        raise ConfigError("--dry-run is answered by an entry point before training (pretrain_gpt.py, "
                          "pretrain_bert.py); this one has none")
    if _env_rank() == 0:
        for note in notes:
            print(note, flush=True)
    if cfg.training.exit_signal_handler:
        signals.install(cfg.training.exit_signal)
    signals.stop_with_launcher()
    heartbeat = None
    try:
        initialize_distributed(cfg.parallel)
        par, t = cfg.parallel, cfg.training
        pstate = ParallelState.build(par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                                     par.virtual_pipeline_model_parallel_size,
                                     timeout=datetime.timedelta(minutes=par.distributed_timeout_minutes))
        print_rank_0(f"> {pstate.describe()}, {t.num_microbatches} microbatches of {t.micro_batch_size} "
                     f"per step, global batch {t.global_batch_size}")
        heartbeat = watchdog.start_heartbeat(par.distributed_timeout_minutes, par.distributed_backend)
        run_lock = check_checkpoint_folders(cfg.checkpointing)
        try:
            yield cfg, pstate
        finally:
            if run_lock is not None:  # an in-process caller may start another run on the same --save
                run_lock.release()
    except BaseException:
        heartbeat = None  # beats on: after a timeout, main_entry reads the other ranks' heartbeats
        raise
    finally:
        signals.release()
        if heartbeat is not None:
            heartbeat.stop()


# ---- what the loop needs --------------------------------------------------------------------------------------
def build_context(cfg: RunConfig, pstate: ParallelState) -> TrainingContext:
    """The tokenizer and the values derived from it, computed once for the whole run."""
    from megatron.core.tokenizer import build_tokenizer

    d = cfg.data
    try:
        tokenizer = build_tokenizer(d.tokenizer_type, vocab_file=d.vocab_file, merge_file=d.merge_file,
                                    tokenizer_model=d.tokenizer_model, vocab_size=d.vocab_size)
    except (ValueError, OSError) as exc:
        raise SharedError(f"--tokenizer-type {d.tokenizer_type}: {exc}") from None
    padded = pad_vocab_size(tokenizer.vocab_size, cfg.model.make_vocab_size_divisible_by, pstate.tp_size)
    print_rank_0(f"> vocabulary {tokenizer.vocab_size} padded to {padded}")
    return TrainingContext(config=cfg, pstate=pstate, tokenizer=tokenizer, padded_vocab_size=padded,
                           eod_id=tokenizer.eod)


def build_model(cfg: RunConfig, pstate: ParallelState, chunks: List[torch.nn.Module]) -> List[torch.nn.Module]:
    """This rank's model chunks, each wrapped for data parallelism (also at DP=1: the optimizer reads the
    gradient buffer's ``main_grad``)."""
    par = cfg.parallel
    ddp_cfg = DDPConfig(overlap_grad_reduce=par.overlap_grad_reduce,
                        use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
                        bucket_size=par.ddp_bucket_size)
    model = [DistributedDataParallel(chunk, pstate=pstate, config=ddp_cfg) for chunk in chunks]
    n_params = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    print_rank_0(f"> parameters on (tensor, pipeline) rank ({pstate.tp_rank}, {pstate.pp_rank}): {n_params:,}")
    return model


def build_optimizer(cfg: RunConfig, model: List[torch.nn.Module], pstate: ParallelState):
    """The mixed-precision optimizer of the optimizer and precision sections."""
    o, p = cfg.optimizer, cfg.precision
    opt_cfg = OptimizerConfig(
        optimizer=o.optimizer, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
        sgd_momentum=o.sgd_momentum, clip_grad=o.clip_grad, bf16=p.bf16, fp16=p.fp16,
        loss_scale=p.loss_scale, initial_loss_scale=p.initial_loss_scale,
        min_loss_scale=p.min_loss_scale, loss_scale_window=p.loss_scale_window,
        hysteresis=p.hysteresis, use_distributed_optimizer=o.use_distributed_optimizer,
        overlap_param_gather=o.overlap_param_gather, capturable=cfg.training.enable_cuda_graph,
        fused_adamw=o.fused_adamw,
    )
    return get_megatron_optimizer(opt_cfg, model, pstate)


def build_scheduler(sc: SchedulerConfig, optimizer) -> OptimizerParamScheduler:
    return OptimizerParamScheduler(optimizer, sc.lr, sc.min_lr, sc.lr_warmup_iters, sc.lr_decay_iters,
                                   sc.lr_decay_style, sc.weight_decay)


def load_checkpoint_if_any(ck: CheckpointConfig, model, optimizer, scheduler,
                           pstate: ParallelState) -> Tuple[int, int]:
    """``(iteration, consumed train samples)`` of the checkpoint in --load, loaded into the model, optimizer and
    scheduler; ``(0, 0)`` without one (an error under --exit-on-missing-checkpoint)."""
    if ck.load and checkpointing.latest_iteration(ck.load) is not None:
        iteration, consumed = checkpointing.load_checkpoint(model, optimizer, scheduler, ck, pstate)
        print_rank_0(f"> loaded checkpoint from {ck.load} at iteration {iteration}")
        return iteration, consumed
    if ck.load:  # --exit-on-missing-checkpoint stopped at start-up (check_checkpoint_folders)
        print_rank_0(f"> no checkpoint found in --load {ck.load}; starting from scratch")
    return 0, 0


def build_iterators(ctx: TrainingContext, datasets_provider, consumed_train: int, consumed_valid: int,
                    chunks: int):
    """One iterator per model chunk for train/valid/test on ranks that read data (TP rank 0)."""
    from megatron.core.datasets.samplers import build_pretraining_data_loader

    t, pstate = ctx.config.training, ctx.pstate
    gbs = t.global_batch_size
    eval_runs = (t.train_iters // t.eval_interval + 1) if t.eval_iters else 0
    num_samples = (t.train_iters * gbs, eval_runs * t.eval_iters * gbs, t.eval_iters * gbs)
    train_ds, valid_ds, test_ds = datasets_provider(ctx, num_samples)
    if num_samples[0] > 0 and train_ds is None:
        raise SharedError(f"--split {ctx.config.data.split} leaves no training data, but {t.train_iters} training "
                          "iterations were asked for; give the train split a share")
    # Whether a split exists is one decision for the whole job: a rank that skips an evaluation its peers run
    # would leave them waiting in the evaluation's collectives (e.g. an empty test split of --split 98,2,0).
    exists = job_flags([ds is not None for ds in (train_ds, valid_ds, test_ds)], dtype=torch.int32)
    if dist.is_initialized():
        dist.all_reduce(exists, op=dist.ReduceOp.MAX)
    if pstate.tp_rank != 0:
        return {split: ([None] * chunks if present else None)
                for split, present in zip(("train", "valid", "test"), exists.tolist())}

    def loaders(ds, consumed):
        if ds is None:
            return None
        out = []
        for _ in range(chunks):
            loader = build_pretraining_data_loader(ds, consumed, t.micro_batch_size, pstate.dp_rank,
                                                   pstate.dp_size, num_workers=ctx.config.data.num_workers)
            out.append(iter(loader))
        return out

    return {"train": loaders(train_ds, consumed_train), "valid": loaders(valid_ds, consumed_valid),
            "test": loaders(test_ds, 0)}


# ---- ending the process ---------------------------------------------------------------------------------------
def main_entry(run: Callable[[], object]) -> None:
    """Run an entry point; configuration, data and checkpoint errors end the process with status 2 and one line.

    An error every rank shares (``SharedError``: flags, rank 0's data errors, a non-finite loss) is printed by
    rank 0 only; the other ranks wait a moment before exiting so that a launcher stopping the job on the first
    exit does not cut rank 0 off before it prints.
    """
    try:
        run()
        if dist.is_initialized():
            sync_device()
            dist.barrier()  # no rank tears its process group down while a peer still communicates
    except SharedError as exc:
        if _env_rank() == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        else:
            time.sleep(3.0)
        _exit(2)
    except (ValueError, cio.CheckpointIOError, RunLockError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        _exit(2)
    except RuntimeError as exc:
        first = (str(exc).splitlines() or [""])[0]
        if watchdog.is_lost_peer(first):  # checked first: gloo's "connection reset" text also says "timed out"
            line = watchdog.describe_lost_peer(_env_rank(), _short_gloo_error(first))
        elif "timed out" in first.lower() or "timeout" in first.lower():
            line = watchdog.describe_timeout(_env_rank(), first)
        else:
            raise
        print(f"error: {line}", file=sys.stderr, flush=True)
        _exit(1)
    finally:
        watchdog.stop_heartbeat()
        if dist.is_initialized():
            dist.destroy_process_group()


def _short_gloo_error(line: str) -> str:
    """gloo's message without its source location and advice: ``Read error [127.0.0.1]:22919: Connection reset by
    peer``."""
    line = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", line.strip())
    return line.split(". This is typically caused", 1)[0]


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.exit(code)
