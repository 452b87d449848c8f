"""The iteration log line (Megatron's field names), FLOP counting and TensorBoard scalars."""

from __future__ import annotations

import datetime
import math
from typing import Dict, Optional

import torch


def num_floating_point_operations(args, batch_size: int) -> float:
    """Model FLOPs of one training iteration (forward + backward = 3 x forward), no recomputation counted.

    Per token and layer the GEMMs cost 2*(4h^2 + 2*h*ffn) FLOPs forward, attention scores and x V cost 4*s*h,
    and the output layer 2*h*V: for ffn = 4h this is Megatron's 72*L*h^2 + 12*L*h*s + 6*h*V per token.
    """
    h, L, s, ffn = args.hidden_size, args.num_layers, args.seq_length, args.ffn_hidden_size
    per_token_fwd = L * (2 * (4 * h * h + 2 * h * ffn) + 4 * s * h) + 2 * h * args.padded_vocab_size
    return 3.0 * per_token_fwd * batch_size * s


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


def format_eval_line(prefix: str, losses: Dict[str, float]) -> str:
    parts = [f" {prefix} |"]
    for key, value in losses.items():
        ppl = math.exp(min(20.0, value))
        parts.append(f" {key} value: {value:.6E} | {key} PPL: {ppl:.6E} |")
    return "".join(parts)


class TensorBoardLogger:
    """Writes scalars on one rank when ``--tensorboard-dir`` is given; a no-op otherwise."""

    def __init__(self, log_dir: Optional[str], enabled: bool):
        self.writer = None
        if log_dir and enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir, max_queue=1000)

    def scalars(self, iteration: int, values: Dict[str, float]) -> None:
        if self.writer is None:
            return
        for key, value in values.items():
            if value is not None:
                self.writer.add_scalar(key, value, iteration)
        if torch.cuda.is_available():
            self.writer.add_scalar("mem-allocated-bytes", torch.cuda.memory_allocated(), iteration)
            self.writer.add_scalar("mem-max-allocated-bytes", torch.cuda.max_memory_allocated(), iteration)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
