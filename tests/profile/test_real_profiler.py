"""The profiler's memory search on a real GPU: the allocator's own out-of-memory sets the limit."""

import pytest
import torch

from poplar.models.workload import as_workload

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_the_largest_micro_batch_fits_and_one_more_runs_out_of_memory():
    from poplar.devices.cuda import CudaDevice, drop_grad
    from poplar.profile.probe import forward_backward, largest_micro_batch

    device, wl = CudaDevice(), as_workload("small")
    assert largest_micro_batch(device, wl, 0, limit=1) == 1     # warm-up: cuBLAS keeps its workspace
    device.free_memory()
    before = torch.cuda.memory_allocated(device.index)
    free, _ = torch.cuda.mem_get_info(device.index)
    state = free - 512 * 2**20            # model states that leave the probe ~0.5 GiB of the GPU
    limit = largest_micro_batch(device, wl, state, limit=4096)
    assert 0 < limit < 4096               # set by the GPU's memory, not by the search's cap
    assert torch.cuda.memory_allocated(device.index) == before    # out-of-memory errors leave nothing behind
    # the probe's conditions: its model on the GPU, the rest of the states reserved beside it
    model = wl.build().to(device.torch_device)
    hooks = [p.register_post_accumulate_grad_hook(drop_grad) for p in model.parameters()]
    own = sum(p.numel() * p.element_size() for p in model.parameters())
    with device.reserve(state - own):
        with pytest.raises(torch.OutOfMemoryError):
            forward_backward(device, model, wl, limit + 1)
        device.free_memory()
        forward_backward(device, model, wl, limit)            # and the limit still fits after it
    for h in hooks:
        h.remove()
    # fewer states leave room for more samples
    assert largest_micro_batch(device, wl, state - 256 * 2**20, limit=4096) > limit
