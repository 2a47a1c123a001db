"""The documentation holds: the site builds strictly (a broken link or a page left out fails it), every
``poplar`` command a page shows names a command and options the CLI has, and the pages read as a guide,
not a notebook (the README's length; no dated asides or issue numbers outside the benchmarks and the
changelog).

The commands are checked against the CLI's own click objects (``typer.main.get_command``), in this
process; only the site builds start a process (``mkdocs``), and are marked ``slow``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.poplar_commands import cli_problems, command_lines

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
DATED_PAGES_ALLOWED = {"benchmarks.md", "CHANGELOG.md"}   # measurements and history keep their dates
DATE = re.compile(r"20\d\d-[01]\d-[0-3]\d")
ISSUE = re.compile(r"(?<![\w&/])#\d+\b")
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
MAX_README_LINES = 165


def poplar_commands(markdown: str) -> list[list[str]]:
    """Every ``poplar`` command line of the text's fenced ``bash`` blocks, as its tokens after ``poplar``
    (:func:`tests.helpers.poplar_commands.command_lines` of each block)."""
    return [command for block in BASH_BLOCK.findall(markdown) for command in command_lines(block)]


def test_every_command_in_the_docs_is_one_the_cli_has():
    found = {page.name: poplar_commands(page.read_text()) for page in PAGES}
    commands = [c for cs in found.values() for c in cs]
    assert len(commands) >= 30, f"only {len(commands)} poplar commands found in the docs' bash blocks"
    assert {c[0] for c in commands if c} >= {"demo", "profile", "plan", "train", "simulate", "bench"}
    assert found["README.md"], "the README shows no poplar command in a bash block"
    assert cli_problems(commands) == []


def test_a_flag_the_cli_does_not_have_is_found():
    page = "```bash\npoplar train --cluster both-differ --global-batch 8 --no-such-flag 3 --out r\n" \
           "torchrun --nproc-per-node 2 -m poplar.cli.main profile \\\n    --model tiny --colour red\n" \
           "pip install -e . && poplar trian --steps 2   # a typo\n```\n"
    commands = poplar_commands(page)
    assert [c[0] for c in commands] == ["train", "profile", "trian"]
    problems = cli_problems(commands)
    assert len(problems) == 3, problems
    assert "--no-such-flag" in problems[0] and "--colour" in problems[1] and "'trian'" in problems[2]


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES})"


@pytest.mark.parametrize("page", [p for p in PAGES if p.name not in DATED_PAGES_ALLOWED], ids=lambda p: p.name)
def test_no_dated_asides_or_issue_numbers(page):
    text = page.read_text()
    dates = DATE.findall(text)
    assert len(dates) <= 2, f"{page.name} has {len(dates)} date stamps ({', '.join(dates[:5])}...): " \
                            "measurements go to docs/benchmarks.md, history to CHANGELOG.md"
    assert ISSUE.findall(text) == [], f"{page.name} names issues {ISSUE.findall(text)}"


def _build(config_dir: Path, site: Path) -> subprocess.CompletedProcess:
    # no -q: mkdocs counts the warnings that --strict turns into a failure only at the level it logs at
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                          cwd=config_dir, capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_the_docs_site_builds_strictly(tmp_path):
    result = _build(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "benchmarks" / "index.html").exists()


@pytest.mark.slow
@pytest.mark.parametrize("breakage, named", [
    ("a link to a page that does not exist", "no-such-page.md"),
    ("a link to an anchor a page does not have", "no-such-heading"),
    ("a page left out of the nav", "unlisted.md"),
])
def test_the_strict_build_fails_on(tmp_path, breakage, named):
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(DOCS, tmp_path / "docs")
    index = tmp_path / "docs" / "index.md"
    if named == "unlisted.md":
        (tmp_path / "docs" / "unlisted.md").write_text("# A page no one listed\n")
    elif named == "no-such-heading":
        index.write_text(index.read_text() + "\nSee [the planner](plan.md#no-such-heading).\n")
    else:
        index.write_text(index.read_text() + "\nSee [a page](no-such-page.md).\n")
    result = _build(tmp_path, tmp_path / "site")
    assert result.returncode != 0, f"the strict build passed {breakage}"
    assert named in result.stdout + result.stderr
