"""Loss scalers for fp16: a constant scale, and a dynamic one that backs off on overflow and grows when clean."""

from __future__ import annotations

import torch


class ConstantGradScaler:
    """A fixed loss scale (``--loss-scale``); overflowing steps are still skipped."""

    def __init__(self, scale: float, device=None):
        self._scale = torch.tensor([float(scale)], dtype=torch.float32, device=device)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": float(self._scale.item())}

    def load_state_dict(self, state: dict) -> None:
        self._scale.fill_(float(state["scale"]))


class DynamicGradScaler(ConstantGradScaler):
    """Dynamic loss scale.

    * every clean step adds one to the growth tracker; after ``growth_interval`` (``--loss-scale-window``)
      clean steps in a row the scale is multiplied by ``growth_factor`` (2) and the hysteresis budget is
      refilled;
    * every overflow resets the growth tracker and spends one unit of the hysteresis budget
      (``--hysteresis``); once the budget is spent, the scale is multiplied by ``backoff_factor`` (0.5), never
      below ``min_scale``. So from a fresh state, ``hysteresis`` consecutive overflows halve the scale.
    """

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2, device=None):
        if not (initial_scale > 0 and min_scale > 0 and initial_scale >= min_scale):
            raise ValueError(
                f"--initial-loss-scale ({initial_scale}) must be >= --min-loss-scale ({min_scale}) > 0"
            )
        super().__init__(initial_scale, device)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                new = max(float(self._scale.item()) * self.backoff_factor, self.min_scale)
                self._scale.fill_(new)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self._scale.mul_(self.growth_factor)

    def state_dict(self) -> dict:
        return {"scale": float(self._scale.item()), "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self._scale.fill_(float(state["scale"]))
        self.growth_tracker = int(state.get("growth_tracker", 0))
        self.hysteresis_tracker = int(state.get("hysteresis_tracker", self.hysteresis))
