"""What the commands print: the console and the progress of long waits are :mod:`poplar.progress`'s, which the
integrations show too; the commands' own shared words are here."""

from __future__ import annotations

from poplar.progress import HEARTBEAT_S, LOG_WIDTH, Progress, console, say

CHECKPOINTING_HELP = "each block keeps only its input and computes again in the backward (less memory, more compute)"

__all__ = ["CHECKPOINTING_HELP", "HEARTBEAT_S", "LOG_WIDTH", "Progress", "console", "say"]
