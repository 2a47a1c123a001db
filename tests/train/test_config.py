"""The training config's sections: each component gets its own (the trainer, the composition root, holds the
whole), holding the config's values; the learning-rate schedule walked over seeded configs."""

import random
from pathlib import Path

import pytest

from poplar.train.config import load_config


@pytest.mark.parametrize("seed", range(6))
def test_each_section_holds_the_configs_values_and_the_schedule_warms_up_then_decays_to_a_tenth(seed):
    rng = random.Random(seed)
    steps = rng.randint(1, 200)
    fields = {"lr": rng.uniform(1e-5, 1e-2), "steps": steps, "warmup_steps": rng.randint(0, steps),
              "checkpoint_every": rng.randint(0, 9), "keep_checkpoints": rng.randint(1, 4), "resume": rng.random() < .5,
              "seed": rng.randint(0, 99), "log_every": rng.randint(1, 5), "seq_len": rng.randint(2, 512),
              "out": f"runs/r{seed}"}
    cfg = load_config(None, fields)
    ck, log, lr = cfg.checkpointing, cfg.logging, cfg.schedule
    assert (ck.out, ck.root, ck.every, ck.keep, ck.resume, ck.seed, ck.data) == (
        Path(fields["out"]), Path(fields["out"]) / "checkpoints", fields["checkpoint_every"],
        fields["keep_checkpoints"], fields["resume"], fields["seed"], cfg.data)
    assert (log.out, log.every, log.steps, log.seq_len, log.schedule) == (
        Path(fields["out"]), fields["log_every"], steps, fields["seq_len"], lr)
    rates = [lr.at(s) for s in range(steps + 5)]
    warm = fields["warmup_steps"]
    assert rates[:warm] == pytest.approx([fields["lr"] * (s + 1) / warm for s in range(warm)])
    after = rates[warm:steps]
    assert all(a >= b for a, b in zip(after, after[1:]))                       # decays, never rises
    assert rates[-1] == pytest.approx(fields["lr"] / 10) and max(rates) <= fields["lr"] * (1 + 1e-12)
