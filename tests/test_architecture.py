"""The package's shape, checked: data flows one way, no import circles, readable sizes.

cluster -> profile -> plan -> engine -> train -> report: a part never imports a part
downstream of it (imports inside functions count too), and no two parts import each other.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "poplar"

# what each part may never import (downstream of it, or beside it where it must not know)
FORBIDDEN = {
    "poplar.cluster": {"poplar.engine", "poplar.devices", "poplar.emulate", "poplar.profile", "poplar.planner",
                       "poplar.train", "poplar.compare.measure", "poplar.compare.peers"},
    "poplar.engine": {"poplar.cluster", "poplar.devices", "poplar.emulate", "poplar.profile", "poplar.planner",
                      "poplar.train", "poplar.compare.measure", "poplar.compare.peers", "poplar.processes.spawn", "poplar.models.workload"},
    "poplar.emulate": {"poplar.profile", "poplar.planner", "poplar.train", "poplar.compare.measure", "poplar.compare.peers"},
    "poplar.devices": {"poplar.profile", "poplar.planner", "poplar.train", "poplar.compare.measure", "poplar.compare.peers"},
    "poplar.profile": {"poplar.planner", "poplar.train", "poplar.compare.measure", "poplar.compare.peers", "poplar.compare.bench",
                       "poplar.compare.demo"},
    "poplar.planner": {"poplar.engine", "poplar.devices", "poplar.emulate", "poplar.train", "poplar.compare.measure",
                       "poplar.compare.peers", "poplar.processes.spawn", "poplar.compare.bench", "poplar.compare.demo"},
    "poplar.train": {"poplar.compare.bench", "poplar.compare.demo", "poplar.compare.measure", "poplar.compare.peers", "poplar.cli"},
    # the simulator writes a profile beside the profiler: upstream of planning, the profiler knows nothing of it
    "poplar.simulate": {"poplar.planner", "poplar.train", "poplar.compare.measure", "poplar.compare.peers", "poplar.compare.bench",
                        "poplar.compare.demo", "poplar.cli"},
}
for _part_name in ("poplar.cluster", "poplar.engine", "poplar.emulate", "poplar.devices", "poplar.profile",
                   "poplar.planner"):
    FORBIDDEN[_part_name] = FORBIDDEN[_part_name] | {"poplar.simulate"}
# the integrations drive the engine from other loops: downstream of everything they use, used by nothing
FORBIDDEN["poplar.integrations"] = {"poplar.compare.bench", "poplar.compare.demo", "poplar.compare.measure", "poplar.compare.peers", "poplar.cli"}
for _part_name in ("poplar.cluster", "poplar.engine", "poplar.emulate", "poplar.devices", "poplar.profile",
                   "poplar.planner", "poplar.train", "poplar.simulate"):
    FORBIDDEN[_part_name] = FORBIDDEN[_part_name] | {"poplar.integrations"}
# how a long wait is shown, by the commands and the integrations alike: it knows nothing of what waits
FORBIDDEN["poplar.progress"] = {"poplar.cluster", "poplar.engine", "poplar.emulate", "poplar.devices", "poplar.profile",
                                "poplar.planner", "poplar.train", "poplar.simulate", "poplar.integrations",
                                "poplar.compare.bench", "poplar.compare.demo", "poplar.compare.measure", "poplar.compare.peers", "poplar.cli"}
# the values every part reads: they import nothing of poplar but these
LEAVES = {"poplar.stages": set(), "poplar.precision": set(), "poplar.split": set(),
          "poplar.plan": {"poplar.stages", "poplar.split"}}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str:
    return ".".join(module.split(".")[:2])


def imports() -> dict[str, set[str]]:
    """Every poplar module's poplar imports, wherever in the module they are."""
    out: dict[str, set[str]] = collections.defaultdict(set)
    for path in ROOT.rglob("*.py"):
        me = _module(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("poplar"):
                out[me].add(node.module)
            elif isinstance(node, ast.Import):
                out[me].update(a.name for a in node.names if a.name.startswith("poplar"))
    return out


def part_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for me, targets in imports().items():
        for t in targets:
            if _part(t) != _part(me) and t != "poplar":
                graph[_part(me)].add(_part(t))
    return graph


def test_no_part_imports_downstream():
    bad = []
    for me, targets in imports().items():
        for t in targets:
            if _part(t) == _part(me) or (t == "poplar" and _part(me) not in LEAVES):
                continue
            if _part(t) in FORBIDDEN.get(_part(me), set()) or (
                    _part(me) in LEAVES and _part(t) not in LEAVES[_part(me)]):
                bad.append(f"{me} imports {t}")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_circle_between_parts():
    graph = part_graph()
    circles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in graph.get(node, ()):
            if nxt in path:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif len(path) < len(graph) + 1:
                visit(nxt, path + [nxt])

    for start in list(graph):
        visit(start, [start])
    assert not circles, "\n".join(sorted(set(circles)))


def module_imports() -> dict[str, set[str]]:
    """Every poplar module's poplar modules imported, wherever in the module: ``from package import module`` is
    the module's."""
    modules = {_module(p) for p in ROOT.rglob("*.py")}
    out: dict[str, set[str]] = collections.defaultdict(set)
    for path in ROOT.rglob("*.py"):
        me = _module(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("poplar"):
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules
                out[me].update(subs or {node.module})
            elif isinstance(node, ast.Import):
                out[me].update(a.name for a in node.names if a.name in modules)
    return out


def test_no_import_circle_between_modules():
    """Inside a part too: no module imports one that imports it back (a package's root left out: it gathers its
    modules for those outside)."""
    packages = {_module(p) for p in ROOT.rglob("__init__.py")}
    graph = {me: {t for t in targets if t not in packages and t != me}
             for me, targets in module_imports().items() if me not in packages}
    circles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in graph.get(node, ()):
            if nxt in path:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in seen:
                seen.add(nxt)
                visit(nxt, path + [nxt])

    for start in graph:
        seen = {start}
        visit(start, [start])
    assert not circles, "\n".join(sorted(set(circles)))


def test_core_code_uses_the_engine_not_the_package_s_front_door():
    """``poplar.initialize`` also reads DeepSpeed's arguments (and imports the integrations): the package's users'
    door. Poplar's own code builds its engine with :func:`poplar.engine.initialize`; only the integrations and the
    command line (which serve users) may import the integrations."""
    front = {"poplar", "poplar.integrations", "poplar.cli"}
    bad = []
    for path in ROOT.rglob("*.py"):
        me = _module(path)
        if _part(me) in front:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            called = isinstance(node, ast.Attribute) and node.attr == "initialize"
            if called and getattr(node.value, "id", "") == "poplar":
                bad.append(f"{me} calls poplar.initialize (line {node.lineno})")
            elif isinstance(node, ast.ImportFrom) and node.module == "poplar" and any(
                    a.name == "initialize" for a in node.names):
                bad.append(f"{me} imports initialize from poplar")
    bad += [f"{me} imports {t}" for me, targets in imports().items() if _part(me) not in front
            for t in targets if _part(t) == "poplar.integrations"]
    assert not bad, "\n".join(sorted(bad))


def test_no_part_imports_another_part_s_private_names():
    """A name with a leading underscore is its part's own: another part imports only what is public."""
    bad = []
    for path in ROOT.rglob("*.py"):
        me = _module(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("poplar."):
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private and _part(node.module) != _part(me):
                    bad.append(f"{me} imports {', '.join(private)} from {node.module}")
    assert not bad, "\n".join(sorted(bad))


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_files_and_functions_are_read_at_once(path):
    src = path.read_text()
    if path.name != "catalogue.py":   # a data table
        assert src.count("\n") <= 400, f"{path}: {src.count(chr(10))} lines (at most 400)"
    long = [f"{node.name}: {node.end_lineno - node.lineno + 1} lines" for node in ast.walk(ast.parse(src))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60]
    assert not long, f"{path}: " + "; ".join(long)
