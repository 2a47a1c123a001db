"""Discovering real CUDA devices: the grouping into kinds, how a real cluster is described, the errors without one."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from poplar.cluster.kinds import CudaProperties
from poplar.cluster.spec import parse_cluster
from poplar.processes.spawn import spawn
from poplar.profile import Profile
from poplar.cluster.catalogue import peak_tflops
from poplar.profile.discover import discover_cluster, group_devices
from poplar.profile.profiler import cache_key
from tests.profile.discover_workers import discover_on_every_rank

ROOT = Path(__file__).resolve().parents[2]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
without_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a machine without CUDA")

H100 = CudaProperties(name="NVIDIA H100 80GB HBM3", total_memory=int(79.1 * 2**30), major=9, minor=0)
A100 = CudaProperties(name="NVIDIA A100-SXM4-40GB", total_memory=40 * 2**30, major=8, minor=0)
EMULATED = {"devices": [{"kind": "big-fast", "count": 2, "memory_gb": 0.04, "tflops": 10.0,
                         "memory_bandwidth_gbs": 500.0}]}


def test_identical_consecutive_devices_are_one_kind_in_rank_order():
    spec = group_devices([H100, A100, A100, H100])
    assert [(d.kind, d.count) for d in spec.devices] == [
        ("NVIDIA H100 80GB HBM3 (79.1 GiB, sm_90)", 1), ("NVIDIA A100-SXM4-40GB (40.0 GiB, sm_80)", 2),
        ("NVIDIA H100 80GB HBM3 (79.1 GiB, sm_90)", 1)]
    assert [d.cuda for d in spec.rank_devices()] == [H100, A100, A100, H100]
    assert spec.world_size == 4 and spec.is_real
    assert spec.memory_bytes(spec.device(1)) == 40 * 2**30 and spec.device(1).memory_gib == 40.0
    assert all(d.is_real and d.gpu is None and d.tflops is None for d in spec.devices)   # its own, none declared
    # the same GPU with other memory or another capability is another kind
    other = [H100, H100.model_copy(update={"total_memory": 94 * 2**30}), H100.model_copy(update={"minor": 1})]
    assert len({d.kind for d in group_devices(other).devices}) == 3
    with pytest.raises(ValueError, match="at least one rank"):
        group_devices([])


def test_a_discovered_cluster_survives_the_trip_to_the_ranks_and_emulated_ones_are_unchanged():
    spec = group_devices([A100, A100])
    assert parse_cluster(spec.model_dump()) == spec                          # as profile_rank receives it
    assert parse_cluster(yaml.safe_load(spec.to_yaml())) == spec
    # an emulated device dumps as it was written (its dict is part of the profile cache's keys)
    emulated = parse_cluster(EMULATED)
    assert emulated.model_dump()["devices"] == EMULATED["devices"] and not emulated.is_real
    assert parse_cluster(emulated.model_dump()) == emulated
    assert "cuda" not in emulated.to_yaml()


@pytest.mark.parametrize("devices, words", [
    ([{"kind": "x", "memory_gb": 0.04}], "devices.0: kind 'x': give gpu: NAME (a catalogue GPU) or declare tflops, "
                                         "memory_bandwidth_gbs"),
    ([{"kind": "x", "speed": 1.0, "memory_gb": 40.0, "cuda": A100.model_dump()}], "devices.0.speed: a device is no "
                                                                                  "longer a speed"),
    ([EMULATED["devices"][0], {"kind": "x", "memory_gb": 40.0, "cuda": A100.model_dump()}],
     "mixes real CUDA devices with emulated ones"),
])
def test_real_and_emulated_kinds_are_told_apart_strictly(devices, words):
    with pytest.raises(ValueError) as e:
        parse_cluster({"devices": devices})
    assert words in str(e.value)


def test_cache_keys_of_real_devices_name_the_gpu():
    def key(props: CudaProperties) -> str:
        return cache_key("tiny", group_devices([props]).devices[0].model_dump(), 0, 1, real=True)

    assert key(H100) == key(H100)
    assert len({key(H100), key(A100), key(H100.model_copy(update={"total_memory": 94 * 2**30})),
                key(H100.model_copy(update={"minor": 1}))}) == 4


@pytest.mark.slow
@without_cuda
def test_without_cuda_discovery_says_to_give_a_cluster_on_every_rank():
    with pytest.raises(ValueError, match=r"give --cluster FILE\|PRESET"):
        discover_cluster()
    # in a group, every rank gathers and raises alike: none is left waiting for another
    assert spawn(discover_on_every_rank, 2, timeout_s=120) == ["no CUDA device to discover"] * 2


@pytest.mark.slow
@without_cuda
@pytest.mark.parametrize("args", [[], ["--cluster", "none"]])
def test_without_cuda_or_a_cluster_file_the_profiler_says_what_to_give(tmp_path, args):
    run = subprocess.run([sys.executable, "-m", "poplar.cli.main", "profile", *args, "--out", str(tmp_path / "p.json")],
                         cwd=ROOT, env={**os.environ, "POPLAR_CACHE_DIR": str(tmp_path), "COLUMNS": "200"},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "no CUDA device to discover" in run.stdout and "--cluster FILE|PRESET" in run.stdout
    assert not (tmp_path / "p.json").exists()


# ---------------------------------------------------------------------------- on a GPU
@needs_cuda
def test_discovers_this_gpu():
    spec = discover_cluster()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    assert spec.world_size == 1 and spec.is_real
    assert spec.memory_bytes(spec.device(0)) == props.total_memory and spec.device(0).is_real
    assert spec.device(0).cuda.name == props.name
    assert spec.device(0).kind.startswith(props.name) and f"sm_{props.major}{props.minor}" in spec.device(0).kind


@pytest.mark.slow
@needs_cuda
def test_profiles_the_real_gpu_without_a_cluster_file(tmp_path):
    env = {**os.environ, "POPLAR_CACHE_DIR": str(tmp_path / "cache"), "CUDA_VISIBLE_DEVICES": "0", "COLUMNS": "200"}
    run = subprocess.run([sys.executable, "-m", "poplar.cli.main", "profile", "--model", "base", "--stages", "0,3",
                          "--points", "3", "--repeats", "2", "--max-micro-batch", "64", "--out", str(tmp_path / "p.json")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    prof = Profile.load(tmp_path / "p.json")
    kind = prof.ranks[0]
    assert len(prof.ranks) == 1 and "sm_" in kind
    # its rating is the data sheet's fp32 peak, or None for a GPU the catalogue does not know
    name = torch.cuda.get_device_properties(0).name
    assert prof.devices[kind].rated_tflops == peak_tflops(name, "fp32")
    for stage in (0, 3):
        sp = prof.stage(kind, stage)
        assert 0 < sp.max_micro_batch <= 64 and sp.state_bytes > 0
        times = [t for _, t in sp.points]
        assert len(times) == 3 and all(t > 0 for t in times)
        assert times[-1] > times[0], sp.points      # more samples take the GPU longer
    assert prof.comm.all_reduce_s > 0


def test_peak_tflops_by_gpu_name_and_dtype():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0      # the more specific name wins
    assert peak_tflops("NVIDIA A100-SXM4-40GB", "fp32") == 19.5
    assert peak_tflops("Tesla V100-SXM2-16GB", "bf16") is None   # no bf16 on a V100
    assert peak_tflops("Some Future GPU", "bf16") is None        # unknown: unrated
