"""The package's shape, checked: floors, low to high; data flows one way; no import circles; readable sizes.

A module never imports a module on a higher floor (imports inside functions count too); parts written on one
floor with ``|`` between them stand beside each other and neither imports the other. ``poplar/__init__`` (the
package's door, its names lazy) and ``poplar/__main__`` stand on no floor.
"""

from __future__ import annotations

import ast
import collections
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "poplar"

# low to high, a floor a line; each name is a part: poplar.<name>, a module at the root or a package
FLOORS = [
    "plan stages precision split lazy",  # the vocabulary: values every part speaks (the only modules at the root)
    "progress",                          # how a long wait is shown: imports nothing of poplar (LEAVES)
    "cluster",
    "models",
    "data",
    "engine",                            # what is trained, and how a step runs
    "emulate",
    "devices",                           # what a rank computes on
    "processes",                         # ranks spawned, signals, a pool: knows no training
    "profile",
    "simulate",
    "planner",                           # measured, counted, chosen
    "runtime",                           # one rank's life, for every front end
    "train | integrations",              # the front ends, beside each other: `poplar train`, other frameworks' loops
    "compare",                           # bench, evaluate, demo, verify, the peers
    "cli",                               # one file per command; every table drawn here
]
DOOR = {"poplar", "poplar.__main__"}     # on no floor
LEAVES = {"poplar.progress"}             # import nothing of poplar
NEVER_IMPORTS = {"poplar.runtime": {"poplar.train", "poplar.integrations", "poplar.compare", "poplar.cli"},
                 "poplar.integrations": {"poplar.train"}}    # no front end on `poplar train`, no rank's life on any
RICH = {"poplar.cli", "poplar.progress"}  # the only parts that draw (rich)


def floors() -> dict[str, tuple[int, int]]:
    """part -> (floor, group): parts of one group may import each other, of two groups on one floor not."""
    return {f"poplar.{name}": (height, group) for height, line in enumerate(FLOORS)
            for group, names in enumerate(line.split("|")) for name in names.split()}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str:
    return ".".join(module.split(".")[:2])


@functools.cache
def _trees() -> list[tuple[str, ast.AST]]:
    return [(_module(path), ast.parse(path.read_text())) for path in sorted(ROOT.rglob("*.py"))]


def imports(prefix: str = "poplar") -> dict[str, set[str]]:
    """Every poplar module's imports of ``prefix`` (a package), wherever in the module they are."""
    def within(name: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    out: dict[str, set[str]] = collections.defaultdict(set)
    for me, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and within(node.module or ""):
                out[me].add(node.module)
            elif isinstance(node, ast.Import):
                out[me].update(a.name for a in node.names if within(a.name))
    return out


def part_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for me, targets in imports().items():
        for t in targets:
            if _part(t) != _part(me) and t not in DOOR and me not in DOOR:
                graph[_part(me)].add(_part(t))
    return graph


def test_every_module_stands_on_a_floor_and_no_loose_module_at_the_root():
    """A new module at ``poplar/`` is one of the vocabulary's (add it to FLOORS) or belongs in a part."""
    on = floors()
    bad = [f"{me} stands on no floor: move it into a part, or add it to FLOORS" for me, _ in _trees()
           if me not in DOOR and _part(me) not in on]
    assert not bad, "\n".join(bad)


def test_every_import_of_poplar_names_a_module_there_is():
    """A module moved is imported from where it is now (an import inside a function fails only when it runs)."""
    there = {me for me, _ in _trees()}
    bad = [f"{me} imports {t}: no such module" for me, targets in imports().items() for t in targets
           if t not in there]
    assert not bad, "\n".join(sorted(bad))


def test_no_module_imports_a_higher_floor_or_a_part_beside_it():
    on = floors()
    bad = []
    for me, targets in imports().items():
        if me in DOOR or _part(me) not in on:
            continue
        for t in targets:
            if _part(t) == _part(me) or t in DOOR or _part(t) not in on:
                continue
            (mine, my_group), (theirs, their_group) = on[_part(me)], on[_part(t)]
            if theirs > mine:
                bad.append(f"{me} imports {t}: a higher floor ({FLOORS[theirs]} above {FLOORS[mine]})")
            elif theirs == mine and their_group != my_group:
                bad.append(f"{me} imports {t}: beside it on its floor ({FLOORS[mine]})")
    assert not bad, "\n".join(sorted(bad))


def test_the_leaves_import_nothing_of_poplar():
    bad = [f"{me} imports {t}" for me, targets in imports().items() if _part(me) in LEAVES
           for t in targets if _part(t) != _part(me)]
    assert not bad, "\n".join(sorted(bad))


def test_no_front_end_imports_train_and_a_rank_s_life_imports_no_front_end():
    """``poplar train`` is one front end: the integrations stand beside it on the runtime, which knows none."""
    bad = [f"{me} imports {t}" for me, targets in imports().items() for t in targets
           if _part(t) in NEVER_IMPORTS.get(_part(me), ())]
    assert not bad, "\n".join(sorted(bad))


def test_only_the_commands_and_the_progress_draw_with_rich():
    bad = [f"{me} imports {t}" for me, targets in imports("rich").items() for t in targets if _part(me) not in RICH]
    assert not bad, "\n".join(sorted(bad))


def circles(graph: dict[str, set[str]]) -> list[str]:
    """Each group of nodes that reach each other, as its shortest circle through its first node and its members."""
    def reach(start: str) -> dict[str, list[str]]:    # node -> a shortest path to it from start
        paths, todo = {}, [[start]]
        while todo:
            path = todo.pop(0)
            for nxt in sorted(graph.get(path[-1], ())):
                if nxt not in paths:
                    paths[nxt] = path + [nxt]
                    todo.append(path + [nxt])
        return paths

    reached = {node: reach(node) for node in graph}
    out, done = [], set()
    for node in sorted(graph):
        if node in done or node not in reached[node]:
            continue
        group = sorted(n for n in reached[node] if node in reached.get(n, {}))
        done.update(group)
        out.append(" -> ".join(reached[node][node]) + (f" (all of {', '.join(group)} reach each other)"
                                                       if len(group) > len(reached[node][node]) - 1 else ""))
    return out


def test_no_import_circle_between_parts():
    assert not (found := circles(part_graph())), "\n".join(found)


def module_imports() -> dict[str, set[str]]:
    """Every poplar module's poplar modules imported, wherever in the module: ``from package import module`` is
    the module's."""
    modules = {me for me, _ in _trees()}
    out: dict[str, set[str]] = collections.defaultdict(set)
    for me, tree in _trees():
        for node in ast.walk(tree):
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
    assert not (found := circles(graph)), "\n".join(found)


def test_core_code_uses_the_engine_not_the_package_s_front_door():
    """``poplar.initialize`` also reads DeepSpeed's arguments (and imports the integrations): the package's users'
    door. Poplar's own code builds its engine with :func:`poplar.engine.initialize`; only the integrations and the
    command line (which serve users) call it."""
    front = {"poplar", "poplar.integrations", "poplar.cli"}
    bad = []
    for me, tree in _trees():
        if _part(me) in front:
            continue
        for node in ast.walk(tree):
            called = isinstance(node, ast.Attribute) and node.attr == "initialize"
            if called and getattr(node.value, "id", "") == "poplar":
                bad.append(f"{me} calls poplar.initialize (line {node.lineno})")
            elif isinstance(node, ast.ImportFrom) and node.module == "poplar" and any(
                    a.name == "initialize" for a in node.names):
                bad.append(f"{me} imports initialize from poplar")
    assert not bad, "\n".join(sorted(bad))


def test_no_part_imports_another_part_s_private_names():
    """A name with a leading underscore is its part's own: another part imports only what is public."""
    bad = []
    for me, tree in _trees():
        for node in ast.walk(tree):
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
