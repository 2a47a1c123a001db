"""What a run prints into a log: tables whole, text as written, progress on every long wait."""

import io
import re
import time

from rich.console import Console
from rich.table import Table

from poplar.progress import LOG_WIDTH, Progress, console, say


def log() -> Console:
    return Console(file=io.StringIO(), width=80)   # what rich takes a pipe for


def test_a_console_that_is_no_terminal_fits_a_wide_table(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    out = console()
    assert not out.is_terminal and out.width >= LOG_WIDTH
    out.file = io.StringIO()
    table = Table(title="bench")
    for col in ("cluster", "stage", "allocation", "samples/s", "vs uniform", "vs proportional", "vs measured-peak",
                "vs deepspeed", "of ideal", "predicted", "overruns"):
        table.add_column(col, justify="right")
    table.add_row("uneven-quantity", "1", "measured-peak (= proportional)", *["1.00x"] * 8)
    out.print(table)
    text = out.file.getvalue()
    assert "\u2026" not in text and "vs measured-peak" in text and "measured-peak (= proportional)" in text


def test_text_is_printed_as_written():
    out = log()
    say(out, "deepspeed: not installed: pip install 'poplar-zero[bench]' (see [docs])")
    assert out.file.getvalue() == "deepspeed: not installed: pip install 'poplar-zero[bench]' (see [docs])\n"


def test_a_log_gets_a_line_per_stage_and_a_heartbeat_in_a_quiet_wait():
    out = log()
    with Progress(out, "both-differ: profiling", heartbeat_s=0.2) as progress:
        for stage in (0, 1):
            progress.put((stage, "memory"))
            progress.put((stage, "round 1/2"))
            progress.put((stage, "done"))
        progress.phase("both-differ: measuring 3 plans")
        time.sleep(0.7)
    lines = out.file.getvalue().splitlines()
    assert lines[:6] == ["both-differ: profiling", "both-differ: stage 0: memory", lines[2],
                         "both-differ: stage 1: memory", lines[4], "both-differ: measuring 3 plans"]
    assert re.fullmatch(r"both-differ: stage 0: done \(\d+ s\)", lines[2])
    assert re.fullmatch(r"both-differ: stage 1: done \(\d+ s\)", lines[4])
    beats = lines[6:]
    assert 1 <= len(beats) <= 4 and all(re.fullmatch(r"both-differ: measuring 3 plans: still running \(\d+ s since "
                                                     r"the last report\)", b) for b in beats), beats


def test_a_wait_shown_after_a_while_says_nothing_when_quick_and_its_phase_when_long():
    quick = log()
    with Progress(quick, "data: rows.jsonl", after_s=0.5) as progress:
        progress.phase("tokenising 12 rows")
    long = log()
    with Progress(long, "data: rows.jsonl", after_s=0.2, heartbeat_s=60) as progress:
        progress.phase("tokenising 100,000 rows")
        time.sleep(0.6)
    assert quick.file.getvalue() == ""
    assert long.file.getvalue().splitlines() == ["data: rows.jsonl", "tokenising 100,000 rows"]


def test_events_may_name_the_device_kind():
    out = log()
    with Progress(out, "c: profiling") as progress:
        progress.put(("a100", 2, "memory"))
    assert out.file.getvalue().splitlines()[1] == "c: a100 stage 2: memory"


def test_the_module_examples_run():
    import doctest

    import poplar.progress.display

    failed, tried = doctest.testmod(poplar.progress.display)
    assert tried > 0 and failed == 0
