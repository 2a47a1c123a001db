"""The per-stage device profiler and the `Profile` it writes."""

from poplar.profile.profile import CommProfile, DeviceProfile, ModelInfo, Profile, StageProfile

__all__ = ["CommProfile", "DeviceProfile", "ModelInfo", "Profile", "StageProfile"]
