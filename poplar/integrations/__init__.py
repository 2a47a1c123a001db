"""Poplar inside the loops people already train with.

- :mod:`poplar.integrations.lightning.strategy`: ``PoplarStrategy`` (``Trainer(strategy="poplar")``);
- :mod:`poplar.integrations.hf.trainer`: ``PoplarTrainer``, a ``transformers.Trainer``;
- :mod:`poplar.integrations.deepspeed.initialize`: ``initialize`` from a DeepSpeed ZeRO config, with
  DeepSpeed's ``forward``/``backward``/``step`` engine calls.

What they share is here: :mod:`~poplar.integrations.session` (one rank's process group,
device, plan and engine, on :mod:`poplar.runtime`: a rank's life for every front end) and
:mod:`~poplar.integrations.sampler` (each rank's slice of every global batch, from any
map-style dataset). Each integration only translates its framework's calls into these.
"""
