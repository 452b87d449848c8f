"""The training loop: ``Trainer.run`` is one loop whose body is one iteration (the step, its accounting and log
line, then evaluation, a checkpoint and the exit checks at their intervals); ``pretrain()`` builds what the loop
needs (``setup.py``), runs it, then saves and evaluates once more."""

from __future__ import annotations

import functools
import math
import time
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core import tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.core.fusions.fp8 import delayed_scaling_step
from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.training import checkpointing, signals, watchdog
from megatron.training.config import RunConfig
from megatron.training.cuda_graph import FullIterationCudaGraph
from megatron.training.downstream_eval import build_downstream_evaluator
from megatron.training.flag_table import SharedError
from megatron.core.model_counts import num_floating_point_operations
from megatron.training.logging import TensorBoardLogger, format_eval_line, format_iteration_line, perplexity
from megatron.training.setup import (build_context, build_iterators, build_model, build_optimizer, build_scheduler,
                                     job_environment, job_flags, load_checkpoint_if_any, print_rank_0,
                                     print_rank_last, sync_device)
from megatron.training.step_executor import CudaGraphStep, EagerStep, StepExecutor, StepResult


class NonFiniteError(SharedError):
    """--check-for-nan-in-loss-and-grad found a non-finite loss or gradient norm (all ranks agree)."""


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
    """Holds what one run needs; ``pretrain()`` builds it and calls ``run()``.

    It reads the training, optimizer, scheduler, precision, logging and checkpointing sections, and of the model
    only the activation shape the pipeline schedule needs.
    """

    def __init__(self, cfg: RunConfig, pstate: ParallelState, model: List[torch.nn.Module], forward_step_func: Callable,
                 iterators: dict, flops_per_iteration: float = 0.0):
        self.pstate, self.model = pstate, model
        self.train_cfg, self.ckpt_cfg, self.log_cfg = cfg.training, cfg.checkpointing, cfg.logging
        self.precision = cfg.precision
        self.activation_shape = dict(seq_length=cfg.model.seq_length, micro_batch_size=cfg.training.micro_batch_size,
                                     hidden_size=cfg.model.hidden_size, dtype=cfg.precision.torch_dtype,
                                     sequence_parallel=cfg.parallel.sequence_parallel)
        self.forward_step_func = forward_step_func
        self.iterators = iterators
        self.flops_per_iteration = flops_per_iteration
        p = cfg.precision
        self.optimizer = build_optimizer(cfg, model, pstate)
        self.scheduler = build_scheduler(cfg.scheduler, self.optimizer)
        self.forward_backward = get_forward_backward_func(pstate)
        self.iteration = 0
        self.consumed_train_samples = 0
        self.skipped_iters = 0
        self.nan_iters = 0
        self.plain_args = cfg.to_plain_dict()
        self.tb = TensorBoardLogger(cfg.logging, pstate.rank == pstate.world_size - 1, self.plain_args)
        self.downstream = None  # a DownstreamEvaluator with --eval-tasks (set by pretrain())
        self.skip_guard = watchdog.SkippedIterationGuard(cfg.training.max_consecutive_skipped_iterations, p.fp16,
                                                         p.loss_scale, p.min_loss_scale)

    # ---- one step ---------------------------------------------------------------------------------------
    def _schedule(self, iterators, forward_only: bool) -> list:
        scale = None
        if self.precision.fp16 and not forward_only:
            scale = lambda loss: loss * self.optimizer.get_loss_scale()  # noqa: E731
        return self.forward_backward(
            forward_step_func=self.forward_step_func, data_iterator=iterators, model=self.model,
            num_microbatches=self.train_cfg.num_microbatches, pstate=self.pstate, **self.activation_shape,
            forward_only=forward_only, grad_scale_func=scale,
            no_sync_func=[chunk.no_sync for chunk in self.model],
            finalize_grads_func=None if forward_only else (lambda m: finalize_model_grads(m, self.pstate)),
        )

    def _reduce_losses(self, stats: list) -> dict:
        """Mean of each stat over microbatches (last stage), then over DP; returned on the last stage."""
        if not self.pstate.is_pipeline_last_stage:
            return {}
        return {key: _dp_mean(value.clone(), self.pstate).item() for key, value in microbatch_means(stats).items()}

    def train_step(self) -> tuple:
        """One eager step: ``(mean losses, update_ok, grad_norm)``; the schedule is advanced by the executor."""
        self.optimizer.zero_grad()  # zeroes every chunk's grad buffer
        delayed_scaling_step()  # --fp8-recipe delayed: this step's scales from the amax history
        stats = self._schedule(self.iterators["train"], forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        return self._reduce_losses(stats), ok, grad_norm

    def captured_train_step(self, static_iterator) -> tuple:
        """One step's GPU work with no host synchronisation (what ``--enable-cuda-graph`` captures)."""
        self.optimizer.zero_grad()
        delayed_scaling_step()
        stats = self._schedule([static_iterator], forward_only=False)
        found_inf, grad_norm = self.optimizer.step_without_sync()
        return microbatch_means(stats), found_inf, grad_norm

    def make_step_executor(self) -> StepExecutor:
        """How each step runs (``step_executor.py``): eagerly, or under ``--enable-cuda-graph`` captured once after
        the warm-up steps and replayed, one step ahead where the loop allows."""
        t = self.train_cfg
        if not t.enable_cuda_graph:
            return EagerStep(self.train_step, self.scheduler)
        graph = FullIterationCudaGraph(
            self.iterators["train"][0], t.num_microbatches, self.train_step, self.captured_train_step,
            self.optimizer.optimizer, t.cuda_graph_warmup_steps, torch.device("cuda", torch.cuda.current_device()))
        return CudaGraphStep(graph, self.scheduler)

    def _may_run_ahead(self, n: int) -> bool:
        """Whether step ``n + 1`` may be launched before step ``n``'s results are read: only when nothing
        (evaluation, a checkpoint, an exit, the end) has to happen after step ``n``. The executor decides whether
        it can (only CUDA-graph replays do)."""
        t = self.train_cfg
        if n >= t.train_iters:
            return False
        return not any(interval and n % interval == 0
                       for interval in (t.eval_interval, self.ckpt_cfg.save_interval, t.exit_interval))

    # ---- evaluation -------------------------------------------------------------------------------------
    def evaluate(self, split: str, label: str) -> Optional[dict]:
        eval_iters = self.train_cfg.eval_iters
        downstream = self.downstream if split == "valid" else None  # --eval-tasks, next to the validation loss
        has_loss = eval_iters > 0 and self.iterators.get(split) is not None
        if not has_loss and downstream is None:
            return None
        for chunk in self.model:
            chunk.eval()
        totals: dict = {}
        with torch.no_grad():
            for _ in range(eval_iters if has_loss else 0):
                for key, value in self._reduce_losses(self._schedule(self.iterators[split], True)).items():
                    totals[key] = totals.get(key, 0.0) + value / eval_iters
        if downstream is not None:
            scores = downstream.evaluate(self.model)
            totals.update(scores)
            self.tb.scalars(self.iteration, scores)
        for chunk in self.model:
            chunk.train()
        if self.pstate.is_pipeline_last_stage:
            print_rank_last("-" * 100)
            print_rank_last(format_eval_line(f"{label} loss at iteration {self.iteration}", totals))
            print_rank_last("-" * 100)
            name = "lm loss validation" if split == "valid" else "lm loss test"
            if "lm loss" in totals:
                self.tb.scalars(self.iteration, {name: totals["lm loss"],
                                                 name + " ppl": perplexity(totals["lm loss"])})
        return totals

    # ---- the loop ---------------------------------------------------------------------------------------
    def save(self) -> None:
        if self.ckpt_cfg.save:
            checkpointing.save_checkpoint(self.iteration, self.model, self.optimizer, self.scheduler, self.ckpt_cfg,
                                          self.pstate, self.consumed_train_samples, self.plain_args)
            print_rank_0(f"saved checkpoint at iteration {self.iteration} to {self.ckpt_cfg.save}")

    def _should_exit_for_time(self, start: float) -> Optional[str]:
        """The reason to stop now (time limit or SIGTERM), decided by all ranks together; None to go on."""
        t = self.train_cfg
        if t.exit_duration_in_mins is None and not t.exit_signal_handler:
            return None
        timed_out = t.exit_duration_in_mins is not None and (time.time() - start) / 60.0 > t.exit_duration_in_mins
        flags = job_flags([float(timed_out), float(signals.received() is not None)])
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # every rank decides together
        if flags[0].item():
            return "exit-duration-in-mins"
        if flags[1].item():
            print_rank_0(f"> --exit-signal {t.exit_signal} received: saving a checkpoint and exiting")
            return "exit-signal-handler"
        return None

    def _check_finite(self, losses: dict, grad_norm: Optional[float]) -> None:
        """--check-for-nan-in-loss-and-grad: stop at a non-finite loss, or gradient norm (except under fp16, where
        the loss scaler skips such steps). The last stage sees the loss, so all ranks agree through a MAX."""
        bad_loss = any(not math.isfinite(v) for v in losses.values())
        bad_grad = grad_norm is not None and not math.isfinite(grad_norm) and not self.precision.fp16
        flags = job_flags([float(bad_loss), float(bad_grad)])
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0].item() or flags[1].item():
            what = "loss" if flags[0].item() else "gradient norm"
            raise NonFiniteError(f"iteration {self.iteration}: the {what} is not finite "
                                 "(--check-for-nan-in-loss-and-grad)")

    def _exit_reason(self, start: float) -> Optional[str]:
        """Why the run stops after this iteration (--exit-interval, time limit, SIGTERM), or None."""
        if self.train_cfg.exit_interval and self.iteration % self.train_cfg.exit_interval == 0:
            return "exit-interval"
        return self._should_exit_for_time(start)

    def _record(self, result: StepResult, dt: float, window: "_LogWindow") -> None:
        """Count one finished iteration, check it, and print/record its log line and TensorBoard scalars."""
        t, ps, log = self.train_cfg, self.pstate, self.log_cfg
        losses, ok, grad_norm = result
        window.add(dt, losses)
        if t.check_for_nan_in_loss_and_grad:
            self._check_finite(losses, grad_norm)
        bad = (grad_norm is not None and not math.isfinite(grad_norm)) or any(
            not math.isfinite(v) for v in losses.values())
        self.skipped_iters += int(not ok)
        self.nan_iters += int(bad)
        lr = self.optimizer.param_groups[0]["lr"]
        tokens_per_iter = t.global_batch_size * self.activation_shape["seq_length"]
        if self.iteration % log.log_interval == 0:
            elapsed, avg = window.take()
            tflops = self.flops_per_iteration / (elapsed * ps.world_size * 1e12) if log.log_throughput else None
            tok_s = tokens_per_iter / elapsed / ps.world_size
            print_rank_last(format_iteration_line(
                self.iteration, t.train_iters, self.consumed_train_samples, elapsed * 1000.0, lr,
                t.global_batch_size, avg, self.optimizer.loss_scale_value(), grad_norm,
                self.skipped_iters, self.nan_iters, tflops, tok_s if log.log_throughput else None))
        self.skip_guard.update(self.iteration, ok, self.optimizer.loss_scale_value())
        if self.iteration % log.tensorboard_log_interval == 0:
            self.tb.scalars(self.iteration, {
                "lm loss": losses.get("lm loss"), "learning-rate": lr, "grad-norm": grad_norm,
                "loss-scale": self.optimizer.loss_scale_value(), "batch-size": t.global_batch_size,
                "throughput-tflops-per-gpu": self.flops_per_iteration / (dt * ps.world_size * 1e12),
                "tokens-per-sec": tokens_per_iter / dt,
            })

    def run(self, start_time: float) -> dict:
        """Train until --train-iters or an exit; one pass of the loop is one iteration: the step, its accounting
        and log line, then evaluation, a checkpoint and the exit checks at their intervals."""
        t = self.train_cfg
        save_interval = self.ckpt_cfg.save_interval
        for chunk in self.model:
            chunk.train()
        executor = self.make_step_executor()
        window = _LogWindow()
        history, total_train_time, exited, n_run = [], 0.0, None, 0
        # An iteration's time runs from the end of the previous one, so the loop's own work (logging, the
        # checks below) counts, as in Megatron's interval timer; evaluation and checkpointing do not (t_end None
        # restarts the clock). An executor that runs ahead has launched the next step when ``step`` returns; an
        # exit decided then waits for that step (``exit_after_in_flight``), which finishes and counts first.
        t_end, exit_after_in_flight = None, None
        while self.iteration < t.train_iters:
            if t_end is None:
                sync_device()
                t_end = time.time()
            watchdog.progress(self.iteration + 1)
            result = executor.step(run_ahead=exit_after_in_flight is None and self._may_run_ahead(self.iteration + 1))
            now = time.time()
            dt, t_end = now - t_end, now
            self.iteration += 1
            n_run += 1
            self.consumed_train_samples += t.global_batch_size
            total_train_time += dt
            self._record(result, dt, window)
            if self.pstate.is_pipeline_last_stage:
                history.append({"iteration": self.iteration, **result.losses, "grad_norm": result.grad_norm})
            if t.eval_interval and self.iteration % t.eval_interval == 0 and self.iteration < t.train_iters:
                self.evaluate("valid", "validation")
                t_end = None
            if save_interval and self.iteration % save_interval == 0:
                self.save()
                t_end = None
            exited = exit_after_in_flight or self._exit_reason(start_time)
            if exited and executor.in_flight:
                exit_after_in_flight, exited = exited, None
                continue
            if exited:
                if not (save_interval and self.iteration % save_interval == 0):
                    self.save()
                print_rank_0(f"exiting at iteration {self.iteration} ({exited})")
                break
        return {"history": history, "train_time": total_train_time, "exited": exited, "iterations_run": n_run}


class _LogWindow:
    """The iterations since the last log line: their time and summed losses, averaged when the line is printed."""

    def __init__(self):
        self.time, self.iters, self.losses = 0.0, 0, {}

    def add(self, dt: float, losses: dict) -> None:
        self.time, self.iters = self.time + dt, self.iters + 1
        for k, v in losses.items():
            self.losses[k] = self.losses.get(k, 0.0) + v

    def take(self) -> tuple:
        """``(mean time per iteration, mean of each loss)`` of the window, which starts over."""
        out = (self.time / self.iters, {k: v / self.iters for k, v in self.losses.items()})
        self.time, self.iters, self.losses = 0.0, 0, {}
        return out




def pretrain(model_provider: Callable, forward_step_func: Callable, datasets_provider: Callable,
             argv: Optional[List[str]] = None, extra_sections: Sequence = ()) -> dict:
    """Run a whole pretraining job; returns a summary (used by tests).

    ``model_provider(ctx)`` returns this rank's model chunks; ``forward_step_func(ctx, data_iterator, model)``
    returns ``(output, loss_func)``; ``datasets_provider(ctx, (n_train, n_valid, n_test))`` returns the three
    datasets; ``ctx`` is a ``TrainingContext``. ``extra_sections``: the entry point's own ``ExtraSection`` s.
    """
    start_time = time.time()
    with job_environment(argv, extra_sections) as (cfg, pstate):
        return _train(cfg, pstate, model_provider, forward_step_func, datasets_provider, start_time)


def _train(cfg: RunConfig, pstate: ParallelState, model_provider: Callable, forward_step_func: Callable,
           datasets_provider: Callable, start_time: float) -> dict:
    t, ck = cfg.training, cfg.checkpointing
    # Megatron offsets the seed per pipeline stage so different stages draw independent dropout masks.
    tensor_parallel.model_parallel_seed(t.seed + 100 * pstate.pp_rank, pstate)
    ctx = build_context(cfg, pstate)
    model = build_model(cfg, pstate, model_provider(ctx))
    flops = num_floating_point_operations(cfg.model.spec(ctx.padded_vocab_size), t.global_batch_size)
    trainer = Trainer(cfg, pstate, model, functools.partial(forward_step_func, ctx), {}, flops)
    from megatron.core.optimizer import optimizer_memory_report

    report = optimizer_memory_report(trainer.optimizer, model)
    print_rank_0("> memory per rank (bytes): " + ", ".join(f"{k} {v:,}" for k, v in report.items()))
    trainer.iteration, trainer.consumed_train_samples = load_checkpoint_if_any(
        ck, model, trainer.optimizer, trainer.scheduler, pstate)
    consumed_valid = (trainer.iteration // t.eval_interval) * t.eval_iters * t.global_batch_size
    # A DataLoader iterator draws its base seed from the global torch generator; building the iterators inside
    # fork_rng leaves the generator where initialisation (or the checkpoint's RNG state) put it, so dropout
    # masks after a resume are those of an uninterrupted run.
    with torch.random.fork_rng(devices=[]):
        trainer.iterators = build_iterators(ctx, datasets_provider, trainer.consumed_train_samples,
                                            consumed_valid, len(model))
    trainer.downstream = build_downstream_evaluator(cfg, ctx.tokenizer, model, pstate)
    if trainer.downstream is not None:
        print_rank_0(f"> zero-shot tasks at every evaluation: {trainer.downstream.describe()}")
    summary = {"iteration": trainer.iteration}
    if not t.skip_train and trainer.iteration < t.train_iters:
        result = trainer.run(start_time)
        for chunk in model:  # --overlap-param-gather leaves the last all-gathers in flight
            chunk.finish_param_sync()
        summary.update(result)
        summary["iteration"] = trainer.iteration
        if result["exited"]:
            trainer.tb.close()
            return summary
        if ck.save and not (ck.save_interval and trainer.iteration % ck.save_interval == 0):
            trainer.save()
        per_iter = result["train_time"] / max(1, result["iterations_run"])
        tflops = flops / (per_iter * pstate.world_size * 1e12)
        print_rank_last(f"training finished at iteration {trainer.iteration}: {result['iterations_run']} iterations "
                        f"in {result['train_time']:.1f} s, "
                        f"{per_iter * 1000:.1f} ms/iteration, {tflops:.3f} TFLOP/s/GPU")
    summary["valid"] = trainer.evaluate("valid", "validation")
    summary["test"] = trainer.evaluate("test", "test")
    trainer.tb.close()
    return summary
