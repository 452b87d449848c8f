"""Learning-rate schedule (Megatron's): linear warm-up from 0, then constant / linear / cosine decay to min_lr."""

from __future__ import annotations

import math


class OptimizerParamScheduler:
    """Sets ``lr`` (x ``lr_mult``) and ``weight_decay`` (x ``wd_mult``) on the optimizer's param groups.

    Steps are counted in iterations; the trainer calls ``step()`` once per successful iteration (a step skipped
    for a non-finite gradient does not advance the schedule).
    """

    def __init__(self, optimizer, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
                 decay_style: str, weight_decay: float):
        if decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"--lr-decay-style must be constant, linear or cosine, got {decay_style}")
        self.optimizer = optimizer
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.decay_style = decay_style
        self.weight_decay = weight_decay
        self.num_steps = 0
        self.step(0)

    def get_lr(self) -> float:
        return self.lr_at(self.num_steps)

    def group_lrs(self, increment: int = 0) -> list:
        """Each param group's learning rate after ``increment`` more steps, without stepping."""
        lr = self.lr_at(self.num_steps + increment)
        return [lr * group.get("lr_mult", 1.0) for group in self.optimizer.param_groups]

    def lr_at(self, n: int) -> float:
        """The learning rate after ``n`` steps."""
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.max_lr * n / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if n > self.decay_steps:
            return self.min_lr
        span = self.decay_steps - self.warmup_steps
        ratio = (n - self.warmup_steps) / span if span > 0 else 1.0
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
        for group, lr in zip(self.optimizer.param_groups, self.group_lrs()):
            group["lr"] = lr
            group["weight_decay"] = self.weight_decay * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict:
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "warmup_steps": self.warmup_steps,
                "decay_steps": self.decay_steps, "decay_style": self.decay_style,
                "weight_decay": self.weight_decay, "num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        # The schedule's shape comes from this run's flags; only the position is restored.
        self.num_steps = 0
        self.step(int(state["num_steps"]))
