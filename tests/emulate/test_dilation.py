"""The time dilation's bound: the worst ratio of host to device time over the micro-batches a card can run."""

from __future__ import annotations

import doctest
import random

import pytest

import poplar.emulate.dilation
from poplar.cluster.spec import parse_cluster
from poplar.devices import rank_device
from poplar.devices.emulated import EmulatedDevice
from poplar.emulate.dilation import largest_samples, worst_ratio
from poplar.profile.probe import largest_micro_batch
from poplar.models.workload import Workload


def test_its_examples():
    failed, tried = doctest.testmod(poplar.emulate.dilation)
    assert tried > 0 and failed == 0


def _brute(host, device, most):
    (a, b), (c, d) = host, device      # a + b m on the host, c + d m on the device
    return max((a + b * m) / (c + d * m) for m in range(1, most + 1))


@pytest.mark.parametrize("seed", range(40))
def test_the_worst_ratio_is_the_largest_over_every_micro_batch_up_to_the_most(seed):
    rng = random.Random(seed)
    host = (rng.uniform(1e-3, 1e-1), rng.uniform(1e-4, 1e-2))
    device = (rng.uniform(1e-5, 1e-3), rng.uniform(1e-7, 1e-4))
    most = rng.randint(1, 400)
    points = [(m, host[0] + host[1] * m, device[0] + device[1] * m) for m in (1, 8)]
    assert worst_ratio(*points, most) == pytest.approx(max(_brute(host, device, most),
                                                           *(r / d for _, r, d in points)), rel=1e-9)
    # with no bound on the micro-batch, the ratio of the costs of a sample more (or of a step of one, if worse)
    assert worst_ratio(*points, None) == pytest.approx(max(host[1] / device[1], points[0][1] / points[0][2],
                                                           points[1][1] / points[1][2]), rel=1e-9)
    assert worst_ratio(*points, most) <= worst_ratio(*points, None) * (1 + 1e-12)


MODELS = [Workload(model="llama-tiny", seq_len=16, vocab_size=256), Workload(model="tiny"),
          Workload(model="bert-tiny", seq_len=16, vocab_size=256)]


@pytest.mark.parametrize("scale", [0.0001, 0.0004])
@pytest.mark.parametrize("wl", MODELS, ids=lambda w: w.name)
def test_the_most_samples_is_what_the_memory_probe_finds_beside_no_states(wl, scale):
    # the profiler's memory probe, beside no model states, finds the same largest micro-batch the bytes saved at
    # 1 and 8 samples extrapolate to: so no micro-batch any stage runs (its states take room too) is larger
    spec = parse_cluster({"memory_scale": scale, "devices": [{"kind": "t4", "gpu": "T4-16GB"}]})
    device = rank_device(spec, 0, wl)
    most = largest_samples(device, device.probe)
    found = largest_micro_batch(device, wl, 0, limit=4096)
    assert found >= 1 and found <= most <= found + 1, (found, most)


def test_a_probe_that_names_no_model_is_not_bounded():
    spec = parse_cluster({"memory_scale": 0.001, "devices": [{"kind": "t4", "gpu": "T4-16GB"}]})
    assert largest_samples(EmulatedDevice(spec, 0), lambda m: None) is None


@pytest.mark.paced
def test_a_cheap_probe_is_timed_at_its_largest_micro_batch_not_taken_out_from_8_samples():
    # a step whose cost jumps past 8 samples (a host's threads, a kernel's cut): the line through 1 and 8 samples
    # says nothing of it; timed at the largest micro-batch the run takes (cheap here), its ratio is what it runs at
    import time

    import torch

    from poplar.emulate.dilation import probe_ratio

    a = torch.ones(32, 32)

    class Jump:
        model = None

        def __init__(self, most):
            self.most = most

        def __call__(self, m):
            a @ a           # a declared time, the same at every size
            time.sleep(0.001 if m <= 8 else 0.004)

    device = EmulatedDevice(parse_cluster({"devices": [{"kind": "a100", "gpu": "A100-80GB"}]}), 0)
    assert probe_ratio(device, Jump(48)) > 2.5 * probe_ratio(device, Jump(8))
