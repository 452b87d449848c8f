"""Configuration of the optimizer, mixed precision and loss scaling (Megatron's optimizer flags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class OptimizerConfig:
    """What :func:`get_megatron_optimizer` builds.

    optimizer: ``"adam"`` (AdamW, decoupled weight decay) or ``"sgd"`` (``--optimizer``).
    lr, min_lr, weight_decay: initial values; the trainer's scheduler rewrites ``lr``/``weight_decay`` of
        every param group each iteration.
    clip_grad: clip the global L2 grad norm to this value (``--clip-grad``; 0 disables clipping, the norm is
        still computed and returned).
    bf16 / fp16: the model params are bf16 / fp16 and the optimizer keeps fp32 main params.
    loss_scale: a static fp16 loss scale (``--loss-scale``); ``None`` selects dynamic scaling with
        ``initial_loss_scale``, ``min_loss_scale``, ``loss_scale_window`` and ``hysteresis``.
    use_distributed_optimizer: shard fp32 main params and optimizer state over DP (``--use-distributed-optimizer``);
        the model chunks must be wrapped with ``DDPConfig(use_distributed_optimizer=True)``.
    overlap_param_gather: leave the post-step parameter all-gather in flight and wait for each bucket in the
        next forward (``--overlap-param-gather``; distributed optimizer only).
    capturable: build a fused AdamW whose step can be captured in a CUDA graph (``step_without_sync()``,
        ``--enable-cuda-graph``); the learning rate may then be a device tensor.
    fused_adamw: on CUDA with Triton, step AdamW with :class:`~megatron.core.optimizer.fused_adamw.FusedAdamW`,
        which also writes the bf16/fp16 model params in the same pass (``--no-fused-adamw`` selects torch's
        fused AdamW plus a separate copy).
    """

    optimizer: str = "adam"
    lr: float = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    bf16: bool = False
    fp16: bool = False
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    capturable: bool = False
    fused_adamw: bool = True

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"--optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.bf16 and self.fp16:
            raise ValueError("--bf16 and --fp16 are mutually exclusive")
        if self.clip_grad < 0:
            raise ValueError(f"--clip-grad must be >= 0, got {self.clip_grad}")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"--loss-scale must be positive, got {self.loss_scale}")
        if self.initial_loss_scale <= 0 or self.min_loss_scale <= 0:
            raise ValueError(
                f"--initial-loss-scale ({self.initial_loss_scale}) and --min-loss-scale ({self.min_loss_scale}) "
                "must be positive"
            )
        if self.loss_scale_window < 1:
            raise ValueError(f"--loss-scale-window must be >= 1, got {self.loss_scale_window}")
        if self.hysteresis < 1:
            raise ValueError(f"--hysteresis must be >= 1, got {self.hysteresis}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("--overlap-param-gather needs --use-distributed-optimizer")
        if self.capturable and self.optimizer != "adam":
            raise ValueError("a capturable optimizer (--enable-cuda-graph) needs --optimizer adam")
