"""Other systems measured beside Poplar on the same emulated devices (``poplar bench``).

A peer is set up in the parent process as a small picklable value (``name``,
``config()``, ``global_batch_size``, ``local_batch_size(rank)``), started inside every
rank of the measurement's launch with ``start(workload, device.comm)``, and then stepped
like Poplar's engine: ``train_batch(local_batch)``, one optimizer step, under the
rank's emulated device. Today's peer: DeepSpeed ZeRO (:mod:`poplar.compare.peers.deepspeed`).

torch's own DDP, ZeroRedundancyOptimizer and FSDP2 (:mod:`poplar.compare.peers.torch_peers`)
are set up and stepped the same way, on the real clock only (DDP issues its all-reduce
from C++, out of any device's reach): the engine benchmark compares with them.
"""


class PeerFailed(RuntimeError):
    """A peer could not start or run (not installed, a start-up error, out of memory); the message says why."""
