"""The per-stage device profiler and the `Profile` it writes.

- :mod:`~poplar.profile.profile`: the values (``Profile``, ``StageProfile``...), saved as JSON;
- :mod:`~poplar.profile.options`: ``ProfileOptions``, what a profile measures and how;
- :mod:`~poplar.profile.profiler`: ``profile_cluster``, every kind and stage of a cluster;
- :mod:`~poplar.profile.rank`: what each rank runs, and its typed figures (``RankProfile``);
- :mod:`~poplar.profile.probe`: the largest micro-batch that fits (the device decides what fits);
- :mod:`~poplar.profile.timing`: steps and collectives timed on the device's clock;
- :mod:`~poplar.profile.cache`: profiles on disk, keyed by what changes them;
- :mod:`~poplar.profile.run`: ``poplar profile`` as one call (launching as this process was launched);
- :mod:`~poplar.profile.discover`, :mod:`~poplar.profile.report`, :mod:`~poplar.profile.plot`: the real
  GPUs as a cluster, the table a person reads, the fitted curves drawn.
"""

from poplar.profile.options import ProfileOptions
from poplar.profile.profile import CommProfile, DeviceProfile, ModelInfo, Profile, StageProfile

__all__ = ["CommProfile", "DeviceProfile", "ModelInfo", "Profile", "ProfileOptions", "StageProfile"]
