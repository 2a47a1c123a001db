"""How a long wait is shown, in a terminal and in a log alike, by the commands and the integrations.

- :mod:`~poplar.progress.display`: the console (a terminal's width, or wide enough for a
  log), text printed as written, and :class:`Progress`, a wait's bars in a terminal and its
  lines in a log;
- :mod:`~poplar.progress.relay`: the events of every rank of a running process group shown
  by rank 0's display (the profiler's ranks report from wherever their device kind runs).
  It imports torch: the commands import this package before torch, to refuse their input first.
"""

from poplar.progress.display import HEARTBEAT_S, LOG_WIDTH, Progress, console, say

__all__ = ["HEARTBEAT_S", "LOG_WIDTH", "Progress", "console", "say"]
