"""Other systems measured beside Poplar on the same emulated devices (``poplar bench``).

A peer is set up in the parent process as a small picklable value (``name``,
``config()``, ``global_batch_size``, ``local_batch_size(rank)``), started inside every
rank of the measurement's launch with ``start(workload, device)``, and then stepped
like Poplar's engine: ``train_batch(local_batch)``, one optimizer step, under the
rank's emulated device. Today's peer: DeepSpeed ZeRO (:mod:`poplar.peers.deepspeed`).
"""


class PeerFailed(RuntimeError):
    """A peer could not start or run (not installed, a start-up error, out of memory); the message says why."""
