"""The loss scale moves as ``torch.amp.GradScaler``'s does, step for step, and as DeepSpeed's where it adds."""

import random

import pytest
import torch

from poplar.engine.loss_scale import LossScaleConfig, LossScaler


def grad_scaler_scales(overflows: list[bool], **kw) -> list[float]:
    """The scale GradScaler runs each step at, given which steps overflow (a gradient made infinite)."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", **kw)
    scales = []
    for overflow in overflows:
        scaler.scale(torch.ones(()))   # makes the scale on the first call
        scales.append(scaler.get_scale())
        p.grad = torch.full((1,), float("inf") if overflow else 1.0)
        scaler.step(opt)
        scaler.update()
    return scales


def ours(overflows: list[bool], **kw) -> list[float]:
    scaler, scales = LossScaler(LossScaleConfig(min_scale=1e-30, **kw)), []
    for overflow in overflows:
        scales.append(scaler.scale)
        scaler.update(overflow)
    return scales


CONFIGS = [{}, {"growth_interval": 1}, {"growth_interval": 3, "growth_factor": 1.5, "backoff_factor": 0.7},
           {"init_scale": 3.0, "growth_interval": 2, "growth_factor": 1.1, "backoff_factor": 0.3},
           {"init_scale": 2.0 ** 120, "growth_interval": 1, "growth_factor": 2 ** 10}]   # growth past float32's range


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kw", CONFIGS, ids=[str(k) for k in CONFIGS])
def test_the_scale_is_grad_scalers_step_for_step(kw, seed):
    rng = random.Random(seed)
    p = rng.choice([0.05, 0.3, 0.7])   # from rare overflows to mostly overflows
    overflows = [rng.random() < p for _ in range(60)]
    assert ours(overflows, **kw) == grad_scaler_scales(overflows, **kw)


def run(config: LossScaleConfig, overflows: str) -> list[tuple[float, bool]]:
    """(scale, whether an overflow here stops the run) before each step; ``overflows``: 'x' overflow, '.' good."""
    scaler, out = LossScaler(config), []
    for c in overflows:
        out.append((scaler.scale, scaler.at_minimum))
        scaler.update(c == "x")
    return out


def test_hysteresis_spends_overflows_before_the_scale_is_lowered_and_comes_back_when_it_grows():
    cfg = LossScaleConfig(init_scale=16, hysteresis=2, growth_interval=2)
    scales = [s for s, _ in run(cfg, "xx.x..xx")]
    # x: hysteresis 2 -> 1; x: 16 -> 8; .; x: 8 -> 4 (none left); . .: grows to 8, hysteresis back to 2; x: spent
    assert scales == [16, 16, 8, 8, 4, 4, 8, 8]


def test_consecutive_hysteresis_comes_back_after_every_good_step():
    cfg = LossScaleConfig(init_scale=16, hysteresis=2, consecutive_hysteresis=True)
    assert [s for s, _ in run(cfg, "x.x.xx.")] == [16, 16, 16, 16, 16, 16, 8]


def test_the_scale_stops_at_the_minimum_and_says_so():
    cfg = LossScaleConfig(init_scale=4, min_scale=1.5)
    assert run(cfg, "xxx") == [(4, False), (2, False), (1.5, True)]


def test_a_static_scale_never_moves():
    cfg = LossScaleConfig(init_scale=128, dynamic=False, growth_interval=1)
    assert run(cfg, "x..x") == [(128, True)] * 4


def test_the_state_round_trips():
    a = LossScaler(LossScaleConfig(init_scale=64, hysteresis=3))
    for overflow in (True, False, False):
        a.update(overflow)
    b = LossScaler(LossScaleConfig(init_scale=64, hysteresis=3))
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict() == {"scale": 64.0, "growth_tracker": 2, "hysteresis_left": 2}


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="min_scale 8.0 is above init_scale 4.0: lower min_scale"):
        LossScaleConfig(init_scale=4, min_scale=8)
    with pytest.raises(ValueError, match="backoff_factor"):
        LossScaleConfig(backoff_factor=1.5)
