"""The real CUDA device: a step's time is the GPU's, waits are told from compute, memory is the allocator's."""

import pytest
import torch

from poplar.devices import Device
from poplar.devices.cuda import CudaDevice

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_without_cuda_it_says_what_to_use_instead():
    with pytest.raises(RuntimeError, match=r"no CUDA device here.*--cluster FILE\|PRESET"):
        CudaDevice()


def _gpu_seconds(cycles: int) -> float:
    """How long the GPU spins for ``cycles`` (timed by CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


CYCLES = 200_000_000     # ~0.1 s on current GPUs


class _SpinningWork:
    """Stands for a collective the stream waits for: its wait keeps the GPU busy for ``CYCLES``."""

    def wait(self, *args, **kwargs) -> bool:
        torch.cuda._sleep(CYCLES)
        return True


@needs_cuda
def test_a_step_lasts_as_long_as_its_gpu_work_not_its_queueing():
    spin = _gpu_seconds(CYCLES)
    assert spin > 0.01
    plain, real = Device(), CudaDevice()
    with plain, plain.step():
        torch.cuda._sleep(CYCLES)          # only queued: the host's clock barely moves
    torch.cuda.synchronize()
    with real, real.step():
        torch.cuda._sleep(CYCLES)
    assert plain.step_s < 0.5 * spin
    assert real.step_s == pytest.approx(spin, rel=0.2)
    assert real.compute_s == pytest.approx(real.step_s) and real.wait_s < 0.01


@needs_cuda
def test_a_wait_counts_only_the_collective_not_the_compute_queued_before_it():
    spin = _gpu_seconds(CYCLES)
    device = CudaDevice()
    with device, device.step():
        torch.cuda._sleep(CYCLES)          # compute queued before the wait: compute, not waiting
        # through the device's comm, as the engine's are
        device.comm.run("all_reduce", 4, lambda async_op: _SpinningWork(), async_op=False)
    assert device.wait_s == pytest.approx(spin, rel=0.2)
    assert device.compute_s == pytest.approx(spin, rel=0.2)
    assert device.step_s == pytest.approx(2 * spin, rel=0.2)


@needs_cuda
def test_capacity_and_peak_memory_are_the_gpus():
    device = CudaDevice()
    assert device.capacity == torch.cuda.get_device_properties(device.index).total_memory
    with device, device.step():
        big = torch.empty(256 * 2**20, dtype=torch.uint8, device=device.torch_device)
        del big
    assert device.peak_bytes >= 256 * 2**20
    with device, device.step():            # the peak is the step's own
        pass
    assert device.peak_bytes < 256 * 2**20
    before = torch.cuda.memory_allocated(device.index)
    with device.reserve(64 * 2**20):
        assert torch.cuda.memory_allocated(device.index) >= before + 64 * 2**20
    assert torch.cuda.memory_allocated(device.index) == before
