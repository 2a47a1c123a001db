"""Ranks for tests/profile/test_discover.py (importable by spawned processes)."""


def discover_on_every_rank(rank, world_size):
    """Discovery in a group of ranks: what each rank raises (none may hang)."""
    from poplar.profile.discover import discover_cluster

    try:
        discover_cluster()
    except ValueError as e:
        return "no CUDA device to discover" if "no CUDA device to discover" in str(e) else str(e)
    return None
