"""What a refused command is held to (tests/test_bad_input.py, and each feature's own bad input): run in this
process, it answers in one line with an exit code, within :data:`LIMIT_S`, and leaves its folder's files as they
were (:func:`file_digests` before and after)."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from typer.testing import CliRunner

from poplar.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
CLUSTER3 = str(ROOT / "examples" / "cluster-3.yaml")    # an A100-80GB beside two T4-16GB
LIMIT_S = 10   # every case can be known before anything is profiled or launched


def file_digests(tmp: Path) -> dict:
    """Every file under ``tmp`` and its digest: what a refused command must leave as it was."""
    return {str(p.relative_to(tmp)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(tmp.rglob("*")) if p.is_file()}


def run_case(args: list[str], tmp: Path):
    """The exit code, the output and the seconds the command took (``{tmp}`` in ``args``: ``tmp``)."""
    start = time.perf_counter()
    result = CliRunner().invoke(app, [a.replace("{tmp}", str(tmp)) for a in args])
    return result.exit_code, result.output.strip(), time.perf_counter() - start


def refusal(args: list[str], tmp: Path, code: int = 2) -> str:
    """The one line ``poplar`` refuses ``args`` with: exit ``code``, within :data:`LIMIT_S`, no traceback, every
    file under ``tmp`` as it was."""
    before = file_digests(tmp)
    exit_code, output, seconds = run_case(args, tmp)
    assert exit_code == code, output
    assert seconds < LIMIT_S, f"refused after {seconds:.1f} s: {output}"
    assert len(output.splitlines()) == 1 and output.startswith("error: ") and "Traceback" not in output, output
    assert file_digests(tmp) == before                       # nothing written, nothing overwritten
    return output
