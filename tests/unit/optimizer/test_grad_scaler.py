"""Loss-scaler arithmetic: backoff after the hysteresis budget, growth after the window, floors, state dicts."""

import pytest

from megatron.core.optimizer import ConstantGradScaler, DynamicGradScaler, OptimizerConfig


def test_dynamic_backoff_after_hysteresis_and_growth():
    s = DynamicGradScaler(initial_scale=2.0 ** 10, min_scale=1.0, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale.item() == 2.0 ** 10  # first overflow spends hysteresis budget only
    s.update(True)
    assert s.scale.item() == 2.0 ** 9  # second consecutive overflow halves
    s.update(True)
    assert s.scale.item() == 2.0 ** 8  # budget spent: every further overflow halves until growth
    for _ in range(2):
        s.update(False)
    assert s.scale.item() == 2.0 ** 8
    s.update(False)  # third clean step in a row: grow x2 and refill the budget
    assert s.scale.item() == 2.0 ** 9
    s.update(True)
    assert s.scale.item() == 2.0 ** 9
    s.update(False)  # an overflow resets the growth tracker
    s.update(False)
    assert s.scale.item() == 2.0 ** 9


def test_dynamic_respects_min_scale_and_roundtrips():
    s = DynamicGradScaler(initial_scale=4.0, min_scale=2.0, growth_interval=100, hysteresis=1)
    for _ in range(5):
        s.update(True)
    assert s.scale.item() == 2.0
    assert s.inv_scale.item() == 0.5
    t = DynamicGradScaler(initial_scale=1024.0, min_scale=1.0, growth_interval=100, hysteresis=1)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict() == {"scale": 2.0, "growth_tracker": 0, "hysteresis_tracker": -4}
    with pytest.raises(ValueError, match="--initial-loss-scale"):
        DynamicGradScaler(initial_scale=1.0, min_scale=2.0)


def test_constant_scaler_never_changes():
    s = ConstantGradScaler(128.0)
    s.update(True)
    s.update(False)
    assert s.scale.item() == 128.0 and s.state_dict() == {"scale": 128.0}


def test_config_errors_name_flags():
    with pytest.raises(ValueError, match="--optimizer"):
        OptimizerConfig(optimizer="lamb")
    with pytest.raises(ValueError, match="--bf16"):
        OptimizerConfig(bf16=True, fp16=True)
    with pytest.raises(ValueError, match="--overlap-param-gather"):
        OptimizerConfig(overlap_param_gather=True)
    with pytest.raises(ValueError, match="--hysteresis"):
        OptimizerConfig(hysteresis=0)
