"""The iteration log line (Megatron's field names) and TensorBoard scalars (the FLOP count behind its TFLOP/s is
``megatron.core.model_counts``)."""

from __future__ import annotations

import datetime
import math
import os
from typing import Dict, Optional

import torch


def format_iteration_line(
    iteration: int, train_iters: int, consumed_samples: int, elapsed_ms: float, lr: float, global_batch: int,
    losses: Dict[str, float], loss_scale: float, grad_norm: Optional[float], skipped: int, nan: int,
    tflops_per_gpu: Optional[float] = None, tokens_per_sec_per_gpu: Optional[float] = None,
) -> str:
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    parts = [f" [{now}] iteration {iteration:8d}/{train_iters:8d} |",
             f" consumed samples: {consumed_samples:12d} |",
             f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"]
    if tflops_per_gpu is not None:
        prec = 1 if tflops_per_gpu >= 1.0 else 3  # keep CPU-sized numbers readable
        parts.append(f" throughput per GPU (TFLOP/s/GPU): {tflops_per_gpu:.{prec}f} |")
    if tokens_per_sec_per_gpu is not None:
        parts.append(f" tokens per second per GPU: {tokens_per_sec_per_gpu:.1f} |")
    parts.append(f" learning rate: {lr:.6E} |")
    parts.append(f" global batch size: {global_batch:5d} |")
    for key, value in losses.items():
        parts.append(f" {key}: {value:.6E} |")
    parts.append(f" loss scale: {loss_scale:.1f} |")
    if grad_norm is not None:
        parts.append(f" grad norm: {grad_norm:.6f} |")  # Megatron prints 3 decimals; parity checks need more
    parts.append(f" number of skipped iterations: {skipped:3d} |")
    parts.append(f" number of nan iterations: {nan:3d} |")
    return "".join(parts)


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(20) as Megatron does; a non-finite loss stays non-finite (nan, inf)."""
    if not math.isfinite(loss):
        return loss
    return math.exp(min(20.0, loss))


def _number(value: float) -> str:
    return f"{value:.6E}" if math.isfinite(value) else str(value)  # nan / inf / -inf, never a made-up number


def format_eval_line(prefix: str, losses: Dict[str, float]) -> str:
    parts = [f" {prefix} |"]
    for key, value in losses.items():
        if not key.endswith("loss"):  # an accuracy or other statistic: no perplexity
            parts.append(f" {key} value: {_number(value)} |")
            continue
        parts.append(f" {key} value: {_number(value)} | {key} PPL: {_number(perplexity(value))} |")
    return "".join(parts)


class TensorBoardLogger:
    """Writes scalars on one rank to TensorBoard (``--tensorboard-dir``) and Weights & Biases (``--wandb-project``).

    ``cfg`` is the logging section (``LoggingConfig``); with neither destination set this is a no-op.
    """

    def __init__(self, cfg, enabled: bool, run_config: Optional[dict] = None):
        self.writer = None
        self.wandb = None
        if not enabled or cfg is None:
            return
        if cfg.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=cfg.tensorboard_dir, max_queue=cfg.tensorboard_queue_size)
        if cfg.wandb_project:
            self.wandb = _start_wandb(cfg, run_config or {})

    def scalars(self, iteration: int, values: Dict[str, float]) -> None:
        values = {k: v for k, v in values.items() if v is not None}
        if torch.cuda.is_available() and (self.writer is not None or self.wandb is not None):
            values["mem-allocated-bytes"] = torch.cuda.memory_allocated()
            values["mem-max-allocated-bytes"] = torch.cuda.max_memory_allocated()
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(key, value, iteration)
        if self.wandb is not None and values:
            self.wandb.log(values, step=iteration)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def _start_wandb(cfg, run_config: dict):
    """A W&B run (``wandb`` is an optional dependency, imported only when asked for)."""
    try:
        import wandb
    except ImportError:
        raise ValueError("--wandb-project needs the wandb package (pip install wandb)") from None
    save_dir = cfg.wandb_save_dir or os.path.join(cfg.tensorboard_dir or ".", "wandb")
    os.makedirs(save_dir, exist_ok=True)
    return wandb.init(project=cfg.wandb_project, name=cfg.wandb_exp_name, entity=cfg.wandb_entity, dir=save_dir,
                      config=run_config)
