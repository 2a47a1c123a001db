"""What the commands print: a rank's error read as bad input by its class; the console and the progress display
are :mod:`poplar.progress`'s (``tests/progress/test_display.py``)."""

import pytest

import poplar.cli.output
import poplar.progress
from poplar.cli.inputs import is_bad_input_in_rank


def test_the_commands_print_with_the_progress_packages_console_and_display():
    assert poplar.cli.output.Progress is poplar.progress.Progress and poplar.cli.output.say is poplar.progress.say


@pytest.mark.parametrize("error, bad", [
    ("ValueError", True), ("FileNotFoundError", True), ("TypeError", True),
    ("ValidationError", True), ("CheckpointError", True), ("PlanningError", True),   # ValueErrors, by their names
    ("RuntimeError", False), ("OutOfMemoryError", False), ("NonFiniteError", False), (None, False),
])
def test_a_ranks_error_is_bad_input_by_its_class(error, bad):
    import poplar.planner  # noqa: F401  (PlanningError defined)

    assert is_bad_input_in_rank(error) is bad
