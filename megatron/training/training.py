"""The pretraining driver: arguments -> grid -> model -> optimizer -> checkpoint -> train/eval loop -> save."""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megatron.core import tensor_parallel
from megatron.core.distributed import DDPConfig, DistributedDataParallel, finalize_model_grads
from megatron.core.fusions.fp8 import delayed_scaling_step
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.training import checkpointing
from megatron.training.arguments import args_to_plain_dict, params_dtype, parse_args
from megatron.training.logging import (TensorBoardLogger, format_eval_line, format_iteration_line,
                                       num_floating_point_operations)
from megatron.training.scheduler import OptimizerParamScheduler


def print_rank_0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def print_rank_last(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
        print(msg, flush=True)


def initialize_distributed(args_backend: Optional[str] = None, timeout_minutes: int = 10) -> int:
    """Join the process group torchrun describes (NCCL on GPUs, gloo on CPU); return the world size."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if world > 1 and not dist.is_initialized():
        import datetime

        backend = args_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    return world


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def microbatch_means(stats: list) -> dict:
    """Each loss statistic's mean over the microbatches, as 0-dim fp32 device tensors ({} without stats)."""
    if not stats:
        return {}
    return {key: torch.stack([s[key].detach().float().reshape(()) for s in stats]).mean() for key in stats[0]}


def _dp_mean(value: torch.Tensor, pstate: ParallelState) -> torch.Tensor:
    if pstate.dp_size > 1:
        dist.all_reduce(value, group=pstate.dp_group)
        value /= pstate.dp_size
    return value


class Trainer:
    """Holds what one run needs; ``pretrain()`` builds it and calls ``run()``."""

    def __init__(self, args, pstate: ParallelState, model: List[torch.nn.Module], forward_step_func: Callable,
                 iterators: dict):
        self.args, self.pstate, self.model = args, pstate, model
        self.forward_step_func = forward_step_func
        self.iterators = iterators
        opt_cfg = OptimizerConfig(
            optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
            sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
            loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
            min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window,
            hysteresis=args.hysteresis, use_distributed_optimizer=args.use_distributed_optimizer,
            overlap_param_gather=args.overlap_param_gather, capturable=args.enable_cuda_graph,
            fused_adamw=args.fused_adamw,
        )
        self.optimizer = get_megatron_optimizer(opt_cfg, model, pstate)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, args.lr, args.min_lr, args.lr_warmup_iters, args.lr_decay_iters,
            args.lr_decay_style, args.weight_decay,
        )
        self.forward_backward = get_forward_backward_func(pstate)
        self.cuda_graph = None  # built at the first step with --enable-cuda-graph
        self.iteration = 0
        self.consumed_train_samples = 0
        self.skipped_iters = 0
        self.nan_iters = 0
        self.tb = TensorBoardLogger(args.tensorboard_dir, pstate.rank == pstate.world_size - 1)
        self.plain_args = args_to_plain_dict(args)

    # ---- one step ---------------------------------------------------------------------------------------
    def _schedule(self, iterators, forward_only: bool) -> list:
        a = self.args
        scale = None
        if a.fp16 and not forward_only:
            scale = lambda loss: loss * self.optimizer.get_loss_scale()  # noqa: E731
        return self.forward_backward(
            forward_step_func=self.forward_step_func, data_iterator=iterators, model=self.model,
            num_microbatches=a.num_microbatches, seq_length=a.seq_length, micro_batch_size=a.micro_batch_size,
            hidden_size=a.hidden_size, dtype=params_dtype(a), pstate=self.pstate,
            sequence_parallel=a.sequence_parallel, forward_only=forward_only, grad_scale_func=scale,
            no_sync_func=[chunk.no_sync for chunk in self.model],
            finalize_grads_func=None if forward_only else (lambda m: finalize_model_grads(m, self.pstate)),
        )

    def _reduce_losses(self, stats: list) -> dict:
        """Mean of each stat over microbatches (last stage), then over DP; returned on the last stage."""
        if not self.pstate.is_pipeline_last_stage:
            return {}
        return {key: _dp_mean(value.clone(), self.pstate).item() for key, value in microbatch_means(stats).items()}

    def _eager_step(self) -> tuple:
        self.optimizer.zero_grad()  # zeroes every chunk's grad buffer
        delayed_scaling_step()  # --fp8-recipe delayed: this step's scales from the amax history
        stats = self._schedule(self.iterators["train"], forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        return self._reduce_losses(stats), ok, grad_norm

    def _captured_step_body(self, static_iterator) -> tuple:
        """One step's GPU work with no host synchronisation (what ``--enable-cuda-graph`` captures)."""
        self.optimizer.zero_grad()
        delayed_scaling_step()
        stats = self._schedule([static_iterator], forward_only=False)
        found_inf, grad_norm = self.optimizer.step_without_sync()
        return microbatch_means(stats), found_inf, grad_norm

    def launch_step(self, ahead: bool = False):
        """Start one training step; ``finish_step`` reads its results. Eager, the whole step runs here. Under
        ``--enable-cuda-graph`` a replay is launched; ``ahead``: the previous launched step is still unread, so
        this step's learning rate depends on whether that one updates (the graph picks, see cuda_graph.py)."""
        if not self.args.enable_cuda_graph:
            return self._eager_step()
        if self.cuda_graph is None:
            from megatron.training.cuda_graph import FullIterationCudaGraph

            self.cuda_graph = FullIterationCudaGraph(
                self.iterators["train"][0], self.args.num_microbatches, self._eager_step,
                self._captured_step_body, self.optimizer.optimizer, self.args.cuda_graph_warmup_steps,
                torch.device("cuda", torch.cuda.current_device()))
        now = self.scheduler.group_lrs(0)
        return self.cuda_graph.launch(self.scheduler.group_lrs(1) if ahead else now, now)

    def finish_step(self, handle) -> tuple:
        """``(mean losses, update_ok, grad_norm)`` of a launched step; advances the schedule if it updated."""
        losses, ok, grad_norm = self.cuda_graph.finish(handle) if self.args.enable_cuda_graph else handle
        if ok:
            self.scheduler.step(1)
        return losses, ok, grad_norm

    def _may_run_ahead(self, n: int) -> bool:
        """Whether step ``n + 1`` may be launched before step ``n``'s results are read: only replays, and only
        when nothing (evaluation, a checkpoint, an exit, the end) has to happen after step ``n``."""
        a = self.args
        if self.cuda_graph is None or not self.cuda_graph.replaying or n >= a.train_iters:
            return False
        return not any(interval and n % interval == 0
                       for interval in (a.eval_interval, a.save_interval, a.exit_interval))

    # ---- evaluation -------------------------------------------------------------------------------------
    def evaluate(self, split: str, label: str) -> Optional[dict]:
        if self.args.eval_iters == 0 or self.iterators.get(split) is None:
            return None
        for chunk in self.model:
            chunk.eval()
        totals: dict = {}
        with torch.no_grad():
            for _ in range(self.args.eval_iters):
                for key, value in self._reduce_losses(self._schedule(self.iterators[split], True)).items():
                    totals[key] = totals.get(key, 0.0) + value / self.args.eval_iters
        for chunk in self.model:
            chunk.train()
        if self.pstate.is_pipeline_last_stage:
            print_rank_last("-" * 100)
            print_rank_last(format_eval_line(f"{label} loss at iteration {self.iteration}", totals))
            print_rank_last("-" * 100)
            name = "lm loss validation" if split == "valid" else "lm loss test"
            if "lm loss" in totals:
                self.tb.scalars(self.iteration, {name: totals["lm loss"],
                                                 name + " ppl": math.exp(min(20.0, totals["lm loss"]))})
        return totals

    # ---- the loop ---------------------------------------------------------------------------------------
    def save(self) -> None:
        if self.args.save:
            checkpointing.save_checkpoint(self.iteration, self.model, self.optimizer, self.scheduler, self.args,
                                          self.pstate, self.consumed_train_samples, self.plain_args)
            print_rank_0(f"saved checkpoint at iteration {self.iteration} to {self.args.save}")

    def _should_exit_for_time(self, start: float) -> bool:
        if self.args.exit_duration_in_mins is None:
            return False
        flag = torch.tensor([float((time.time() - start) / 60.0 > self.args.exit_duration_in_mins)])
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank decides together
        return bool(flag.item())

    def run(self, start_time: float) -> dict:
        a, ps = self.args, self.pstate
        for chunk in self.model:
            chunk.train()
        flops_per_iter = num_floating_point_operations(a, a.global_batch_size)
        tokens_per_iter = a.global_batch_size * a.seq_length
        window_time, window_iters, window_losses = 0.0, 0, {}
        history, total_train_time, exited, n_run = [], 0.0, None, 0
        # An iteration's time runs from the end of the previous one, so the loop's own work (logging, the
        # checks below) counts, as in Megatron's interval timer; evaluation and checkpointing do not.
        # Under --enable-cuda-graph the next step is launched before this one's results are read (when
        # _may_run_ahead allows), so the GPU replays it while the host logs; ``ahead`` is that launched step.
        t_end, ahead, stop_after_ahead = None, None, None
        while self.iteration < a.train_iters:
            if t_end is None:
                _sync()
                t_end = time.time()
            handle = ahead if ahead is not None else self.launch_step()
            ahead = None
            if stop_after_ahead is None and self._may_run_ahead(self.iteration + 1):
                ahead = self.launch_step(ahead=True)
            losses, ok, grad_norm = self.finish_step(handle)
            if ahead is None:
                _sync()
            now = time.time()
            dt, t_end = now - t_end, now
            self.iteration += 1
            n_run += 1
            self.consumed_train_samples += a.global_batch_size
            total_train_time += dt
            window_time, window_iters = window_time + dt, window_iters + 1
            for k, v in losses.items():
                window_losses[k] = window_losses.get(k, 0.0) + v
            bad = (grad_norm is not None and not math.isfinite(grad_norm)) or any(
                not math.isfinite(v) for v in losses.values())
            self.skipped_iters += int(not ok)
            self.nan_iters += int(bad)
            if ps.is_pipeline_last_stage:
                history.append({"iteration": self.iteration, **losses, "grad_norm": grad_norm})
            lr = self.optimizer.param_groups[0]["lr"]
            if self.iteration % a.log_interval == 0:
                elapsed = window_time / window_iters
                tflops = flops_per_iter / (elapsed * ps.world_size * 1e12) if a.log_throughput else None
                tok_s = tokens_per_iter / elapsed / ps.world_size
                avg = {k: v / window_iters for k, v in window_losses.items()}
                print_rank_last(format_iteration_line(
                    self.iteration, a.train_iters, self.consumed_train_samples, elapsed * 1000.0, lr,
                    a.global_batch_size, avg, self.optimizer.loss_scale_value(), grad_norm,
                    self.skipped_iters, self.nan_iters, tflops, tok_s if a.log_throughput else None))
                window_time, window_iters, window_losses = 0.0, 0, {}
            if self.iteration % a.tensorboard_log_interval == 0:
                self.tb.scalars(self.iteration, {
                    "lm loss": losses.get("lm loss"), "learning-rate": lr, "grad-norm": grad_norm,
                    "loss-scale": self.optimizer.loss_scale_value(), "batch-size": a.global_batch_size,
                    "throughput-tflops-per-gpu": flops_per_iter / (dt * ps.world_size * 1e12),
                    "tokens-per-sec": tokens_per_iter / dt,
                })
            if a.eval_interval and self.iteration % a.eval_interval == 0 and self.iteration < a.train_iters:
                self.evaluate("valid", "validation")
                t_end = None
            if a.save_interval and self.iteration % a.save_interval == 0:
                self.save()
                t_end = None
            if stop_after_ahead is not None:
                exited = stop_after_ahead
            elif a.exit_interval and self.iteration % a.exit_interval == 0:
                exited = "exit-interval"
            elif self._should_exit_for_time(start_time):
                exited = "exit-duration-in-mins"
            if exited and ahead is not None:
                stop_after_ahead, exited = exited, None  # the launched step runs to its end and counts first
                continue
            if exited:
                if not (a.save_interval and self.iteration % a.save_interval == 0):
                    self.save()
                print_rank_0(f"exiting at iteration {self.iteration} ({exited})")
                break
        return {"history": history, "train_time": total_train_time, "exited": exited, "iterations_run": n_run}


def _build_iterators(args, pstate, datasets_provider, consumed_train: int, consumed_valid: int, chunks: int):
    """One iterator per model chunk for train/valid/test on ranks that read data (TP rank 0)."""
    from megatron.core.datasets.samplers import build_pretraining_data_loader

    gbs = args.global_batch_size
    eval_runs = (args.train_iters // args.eval_interval + 1) if args.eval_iters else 0
    num_samples = (args.train_iters * gbs, eval_runs * args.eval_iters * gbs, args.eval_iters * gbs)
    train_ds, valid_ds, test_ds = datasets_provider(args, pstate, num_samples)
    if pstate.tp_rank != 0:
        return {"train": [None] * chunks, "valid": [None] * chunks, "test": [None] * chunks}

    def loaders(ds, consumed):
        if ds is None:
            return None
        out = []
        for _ in range(chunks):
            loader = build_pretraining_data_loader(ds, consumed, args.micro_batch_size, pstate.dp_rank,
                                                   pstate.dp_size, num_workers=args.num_workers)
            out.append(iter(loader))
        return out

    return {"train": loaders(train_ds, consumed_train), "valid": loaders(valid_ds, consumed_valid),
            "test": loaders(test_ds, 0)}


def pretrain(model_provider: Callable, forward_step_func: Callable, datasets_provider: Callable,
             argv: Optional[List[str]] = None) -> dict:
    """Run a whole pretraining job; returns a summary (used by tests)."""
    start_time = time.time()
    world = initialize_distributed()
    args = parse_args(argv, world_size=world)
    if args.distributed_backend and dist.is_initialized() and dist.get_backend() != args.distributed_backend:
        raise ValueError(f"--distributed-backend {args.distributed_backend} but the process group uses "
                         f"{dist.get_backend()}")
    pstate = ParallelState.build(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                 args.virtual_pipeline_model_parallel_size)
    print_rank_0(f"> {pstate.describe()}, {args.num_microbatches} microbatches of {args.micro_batch_size} "
                 f"per step, global batch {args.global_batch_size}")
    # Megatron offsets the seed per pipeline stage so different stages draw independent dropout masks.
    tensor_parallel.model_parallel_seed(args.seed + 100 * pstate.pp_rank, pstate)

    raw_chunks = model_provider(args, pstate)
    ddp_cfg = DDPConfig(overlap_grad_reduce=args.overlap_grad_reduce,
                        use_distributed_optimizer=args.use_distributed_optimizer, bucket_size=args.ddp_bucket_size)
    model = [DistributedDataParallel(chunk, pstate=pstate, config=ddp_cfg) for chunk in raw_chunks]
    n_params = sum(p.numel() for chunk in raw_chunks for p in chunk.parameters())
    print_rank_0(f"> parameters on (tensor, pipeline) rank ({pstate.tp_rank}, {pstate.pp_rank}): {n_params:,}")

    trainer = Trainer(args, pstate, model, forward_step_func, {})
    from megatron.core.optimizer import optimizer_memory_report

    report = optimizer_memory_report(trainer.optimizer, model)
    print_rank_0("> memory per rank (bytes): " + ", ".join(f"{k} {v:,}" for k, v in report.items()))
    if args.load and checkpointing.latest_iteration(args.load) is not None:
        trainer.iteration, trainer.consumed_train_samples = checkpointing.load_checkpoint(
            model, trainer.optimizer, trainer.scheduler, args, pstate)
        print_rank_0(f"> loaded checkpoint from {args.load} at iteration {trainer.iteration}")
    elif args.load:
        print_rank_0(f"> no checkpoint found in {args.load}; starting from scratch")

    consumed_valid = (trainer.iteration // args.eval_interval) * args.eval_iters * args.global_batch_size
    trainer.iterators = _build_iterators(args, pstate, datasets_provider, trainer.consumed_train_samples,
                                         consumed_valid, len(model))
    summary = {"iteration": trainer.iteration}
    if not args.skip_train and trainer.iteration < args.train_iters:
        result = trainer.run(start_time)
        for chunk in model:  # --overlap-param-gather leaves the last all-gathers in flight
            chunk.finish_param_sync()
        summary.update(result)
        summary["iteration"] = trainer.iteration
        if result["exited"]:
            trainer.tb.close()
            return summary
        if args.save and not (args.save_interval and trainer.iteration % args.save_interval == 0):
            trainer.save()
        per_iter = result["train_time"] / max(1, result["iterations_run"])
        tflops = num_floating_point_operations(args, args.global_batch_size) / (per_iter * pstate.world_size * 1e12)
        print_rank_last(f"training finished at iteration {trainer.iteration}: {result['iterations_run']} iterations "
                        f"in {result['train_time']:.1f} s, "
                        f"{per_iter * 1000:.1f} ms/iteration, {tflops:.3f} TFLOP/s/GPU")
    summary["valid"] = trainer.evaluate("valid", "validation")
    summary["test"] = trainer.evaluate("test", "test")
    trainer.tb.close()
    return summary


def main_entry(run: Callable[[], object]) -> None:
    """Run an entry point; flag and checkpoint errors end the process with status 2 and one clear line."""
    try:
        run()
        if dist.is_initialized():
            _sync()
            dist.barrier()  # no rank tears its process group down while a peer still communicates
    except (ValueError, checkpointing.CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
