"""The package's architecture, measured (issue 64): modules, import levels, cycles, imports that run back up the
floors, and the path a `poplar train` run's config takes from the command to the engine's first step.

    cd TREE && PYTHONPATH=TREE python bench/architecture.py --root TREE --floors before|after [--json out.json]

Static, from the AST of every .py under ROOT/poplar (imports anywhere count: in functions, under TYPE_CHECKING):
one edge per (importer, module imported); ``from p import n`` reaches the module p.n where there is one, else the
module p's ``__init__`` re-exports n from, else p. Levels and cycles leave out the ``__init__`` modules that define
no function or class (re-exports only) and ``poplar/__init__`` (the door; ``import poplar`` reaches only it).
Levels: the longest chain of imports, each cycle condensed to one node. An import runs back up when its target's
floor is higher than its importer's, or when both are different parts of one floor (a front end importing another).
Dynamic: the CLI in this process, as torchrun's only rank; every call into a function under ROOT/poplar with the
config as an argument other than ``self``/``cls`` (an instance of --config-classes, or of a pydantic model or
dataclass reachable from one as an attribute, two deep: its sections), up to the first call of ``--stop``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import itertools
import json
import os
import socket
import sys
import tempfile
from contextlib import suppress
from functools import cached_property
from pathlib import Path

# Floors, low to high, one a line: `floor[/part] module-prefix...`; the longest prefix decides. Parts of one floor
# may not import each other (the front ends). 'after' is issue 64's layout: edit it (or LOWER) as the layout lands;
# a prefix that names no module is harmless.
LOWER = """
    vocabulary poplar.plan poplar.stages poplar.precision poplar.split poplar.lazy poplar.progress
    cluster poplar.cluster
    models poplar.models poplar.workload
    data poplar.data
    engine poplar.engine
    emulate poplar.emulate poplar.devices.emulate
    devices poplar.devices
    processes poplar.processes poplar.launch poplar.workers poplar.sigterm
    profile poplar.profile
    simulate poplar.simulate
    planner poplar.planner
    runtime poplar.runtime
"""
# one order of floors for both trees; 'before' names where the same kinds of module lived then
UPPER = """
    front/train poplar.train
    front/integrations poplar.integrations
    compare poplar.compare poplar.bench poplar.measure poplar.evaluate poplar.alone poplar.demo poplar.verify poplar.peers
    cli poplar.cli poplar.__main__
"""
FLOORS = {"before": LOWER + UPPER, "after": LOWER + UPPER}
DOOR = "poplar"
TRAIN_ARGS = "train --model llama-tiny --cluster none --plan {plan} --global-batch 4 --steps 1 --out {out}"


def floor_table(text: str) -> list[tuple[int, str, str]]:
    """(height, part, prefix) rows of one of FLOORS."""
    rows, heights = [], {}
    for head, *prefixes in (line.split() for line in text.splitlines() if line.strip()):
        floor, _, part = head.partition("/")
        heights.setdefault(floor, len(heights))
        rows += [(heights[floor], part or floor, p) for p in prefixes]
    return rows


def floor_of(module: str, table: list) -> tuple[int, str] | None:
    """(height, part) of ``module`` by its longest prefix in ``table``; None for the door or no row."""
    best = max(((len(p), h, part) for h, part, p in table if module == p or module.startswith(p + ".")), default=None)
    return None if module == DOOR or best is None else best[1:]


def runs_up(a: str, b: str, table: list) -> str | None:
    """Why module ``a`` importing (or handing the config to) ``b`` runs back up; None where it does not."""
    fa, fb = floor_of(a, table), floor_of(b, table)
    if fa and fb and fb[0] > fa[0]:
        return f"{fa[1]} -> {fb[1]}: higher floor"
    return f"{fa[1]} -> {fb[1]}: another front end" if fa and fb and fb[0] == fa[0] and fa[1] != fb[1] else None


def _targets(node: ast.AST, here: str, is_pkg: bool) -> list[tuple[str, str | None]]:
    """(module, name imported from it or None) of one import statement in module ``here``."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names]
    base = here if is_pkg else here.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    base = ".".join(p for p in (base if node.level else "", node.module or "") if p)
    return [(base, a.name) for a in node.names]


def _resolve(mod: str, name: str | None, modules: dict, reexports: dict) -> str | None:
    """The module an import reaches (see the module's docstring); None outside the tree."""
    for _ in range(8):
        if name and f"{mod}.{name}" in modules:
            return f"{mod}.{name}"
        if name not in reexports.get(mod, {}):
            break
        mod, name = reexports[mod][name]
    while mod and mod not in modules:
        mod = mod.rpartition(".")[0]
    return mod or None


def import_graph(root: Path) -> tuple[dict[str, set[str]], set[str]]:
    """Module -> the modules it imports; and the ``__init__`` modules that define nothing."""
    files = {p: p.relative_to(root).with_suffix("").parts for p in sorted((root / "poplar").rglob("*.py"))}
    modules = {".".join(parts[:-1] if parts[-1] == "__init__" else parts): p for p, parts in files.items()}
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in modules.items()}
    inits = {m for m, p in modules.items() if p.name == "__init__.py"}
    reexports = {m: {a.asname or a.name: t for n in trees[m].body if isinstance(n, ast.ImportFrom)
                     for t, a in zip(_targets(n, m, True), n.names)} for m in inits}
    hollow = {m for m in inits if not any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in trees[m].body)}
    graph = {}
    for m, tree in trees.items():
        found = {_resolve(t, n, modules, reexports) for node in ast.walk(tree)
                 if isinstance(node, (ast.Import, ast.ImportFrom)) for t, n in _targets(node, m, m in inits)}
        graph[m] = {t for t in found if t and t != m}
    return graph, hollow


def strong_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, each after every one it imports."""
    index, low, stack, comps = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            at = stack.index(v)
            comps.append(sorted(stack[at:]))
            del stack[at:]
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def levels(graph: dict[str, set[str]]) -> tuple[dict[str, int], list[list[str]], list[str]]:
    """Each module's level (1 + the highest it imports, a cycle one node); the cycles; one longest chain."""
    comps = strong_components(graph)
    comp_of = {m: i for i, c in enumerate(comps) for m in c}
    level: dict[int, int] = {}
    for i, comp in enumerate(comps):
        level[i] = 1 + max((level[comp_of[t]] for m in comp for t in graph[m] if comp_of[t] != i), default=0)
    lv = {m: level[comp_of[m]] for m in graph}
    chain = [max(sorted(lv), key=lv.get)]
    while lv[chain[-1]] > 1:
        chain.append(min(t for m in comps[comp_of[chain[-1]]] for t in graph[m] if lv[t] == lv[chain[-1]] - 1))
    return lv, [c for c in comps if len(c) > 1], chain


def static_report(root: Path, table: list) -> dict:
    graph, hollow = import_graph(root)
    core = {m: ts - hollow - {DOOR} for m, ts in graph.items() if m not in hollow | {DOOR}}
    lv, cycles, chain = levels(core)
    return {"modules": len(graph), "packages": sum(1 for _ in (root / "poplar").rglob("__init__.py")),
            "root_modules": sum(1 for p in (root / "poplar").glob("*.py") if p.stem not in ("__init__", "__main__")),
            "import_edges": sum(map(len, graph.values())), "levels": max(lv.values()), "longest_chain": chain,
            "level_sizes": {n: sum(1 for v in lv.values() if v == n) for n in sorted(set(lv.values()))},
            "cycles": cycles, "back_ups": sorted([a, b, why] for a in graph for b in graph[a]
                                                 if (why := runs_up(a, b, table))),
            "left_out": sorted(hollow | {DOOR}), "unfloored": sorted(m for m in graph if m != DOOR
                                                                     and not floor_of(m, table))}


def _sections(obj, depth: int = 2) -> set[type]:
    """Types of the pydantic models and dataclasses reachable from ``obj`` as public attributes or properties."""
    cls, found = type(obj), set()
    names = [*getattr(cls, "model_fields", {}), *getattr(obj, "__dict__", {})]
    names += [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else []
    names += [n for k in cls.__mro__ for n, v in vars(k).items() if isinstance(v, (property, cached_property))]
    for name in dict.fromkeys(n for n in names if not n.startswith("_")):
        value = None
        with suppress(AttributeError, TypeError, ValueError, RuntimeError, OSError):  # unreadable here: no section
            value = getattr(obj, name)
        if not isinstance(value, type) and (dataclasses.is_dataclass(value) or hasattr(type(value), "model_fields")):
            found |= {type(value)} | (_sections(value, depth - 1) if depth > 1 else set())
    return found


class ConfigTracer:
    """A sys.setprofile hook: the calls under ``package`` that receive the config, until ``stop`` is called."""

    def __init__(self, package: Path, classes: set[str], stop: str):
        self.prefix, self.classes, self.stop = str(package) + os.sep, classes, stop
        self.sections: set[type] = set()
        self.calls: list[list] = []     # [module, function, arguments that were the config]
        self.origin, self.stopped = None, False

    def _is_config(self, value) -> bool:
        if type(value).__name__ in self.classes:
            config = getattr(value, "config", value)   # a description: the config it carries, and its sections
            self.sections |= _sections(config) | ({type(config)} if config is not value else set())
            return True
        return type(value) in self.sections

    def _module(self, filename: str) -> str | None:
        if not filename.startswith(self.prefix):
            return None
        return ".".join(("poplar", *Path(filename[len(self.prefix):]).with_suffix("").parts)).removesuffix(".__init__")

    def __call__(self, frame, event, arg):
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(self.prefix):
            return
        if code.co_qualname == self.stop:
            sys.setprofile(None)
            self.stopped = True
            return
        n = code.co_argcount + code.co_kwonlyargcount
        star, stars = bool(code.co_flags & inspect.CO_VARARGS), bool(code.co_flags & inspect.CO_VARKEYWORDS)
        local, names = frame.f_locals, code.co_varnames
        given = [(name, local.get(name)) for i, name in enumerate(names[:n]) if i or name not in ("self", "cls")]
        given += [(names[n], v) for v in local.get(names[n], ())] if star else []
        given += list(local.get(names[n + star], {}).items()) if stars else []
        matched = [name for name, value in given if self._is_config(value)]
        if matched:
            self.origin = self.origin or self._module(frame.f_back.f_code.co_filename)
            self.calls.append([self._module(code.co_filename), code.co_qualname, matched])


def trace_run(root: Path, app_path: str, train_args: str, classes: set[str], stop: str) -> ConfigTracer:
    """The config's calls in one in-process ``poplar train`` run, made as torchrun's only rank would make it."""
    import poplar
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    module, _, attr = app_path.partition(":")
    app = getattr(importlib.import_module(module), attr)
    tracer, here = ConfigTracer(root / "poplar", classes, stop), os.getcwd()
    with tempfile.TemporaryDirectory(prefix="poplar-arch-") as tmp:
        poplar.Plan(zero_stage=0, micro_batch_sizes=[4]).save(Path(tmp) / "plan.json")
        args = train_args.format(plan=Path(tmp) / "plan.json", out=Path(tmp) / "run").split()
        os.chdir(tmp)
        sys.setprofile(tracer)
        try:
            rc = app(args, standalone_mode=False)
        finally:
            sys.setprofile(None)
            os.chdir(here)
    if rc not in (None, 0) or not tracer.stopped:
        sys.exit(f"`poplar {' '.join(args)}` ended ({rc}) before {stop} was called: fix --train-args or --stop")
    return tracer


def path_report(tracer: ConfigTracer, table: list) -> dict:
    """The config's path: the modules in order (the command's first; a module's consecutive calls one entry)."""
    modules = [tracer.origin] * bool(tracer.origin) + [m for m, _, _ in tracer.calls]
    seq = [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]
    return {"calls": tracer.calls, "sections": sorted(t.__qualname__ for t in tracer.sections), "sequence": seq,
            "distinct_modules": len(set(seq)), "entries": len(seq),
            "returns": sum(1 for i, m in enumerate(seq) if m in seq[:i]),
            "train_entries": sum(1 for m in seq if m == "poplar.train" or m.startswith("poplar.train.")),
            "climbs": sum(1 for a, b in itertools.pairwise(seq) if runs_up(a, b, table))}


def show(report: dict) -> None:
    s, p = report["static"], report["path"]
    print(f"\npoplar: {report['poplar_file']} (floors: {report['floors']})")
    for key in ("modules", "packages", "root_modules", "import_edges", "levels", "level_sizes"):
        print(f"  {key.replace('_', ' '):<30}{s[key]}")
    print(f"  {'longest chain':<30}{' > '.join(s['longest_chain'])}")
    print(f"  {'import cycles':<30}{len(s['cycles'])}" + "".join(f"\n    {' <-> '.join(c)}" for c in s["cycles"]))
    print(f"  {'imports that run back up':<30}{len(s['back_ups'])}")
    for a, b, why in s["back_ups"]:
        print(f"    {a} -> {b}   ({why})")
    print(f"  {'modules on no floor':<30}{', '.join(s['unfloored']) or '-'}")
    print(f"  {'left out of levels, cycles':<30}{', '.join(s['left_out'])}")
    if p:
        print(f"config's path to the first step: {len(p['calls'])} calls; sections: {', '.join(p['sections'])}")
        for key in ("distinct_modules", "entries", "returns", "train_entries", "climbs"):
            print(f"  {key.replace('_', ' '):<30}{p[key]}")
        print("  " + " > ".join(m.removeprefix("poplar.") for m in p["sequence"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path.cwd(), help="the tree holding poplar/")
    ap.add_argument("--floors", choices=sorted(FLOORS), default="after")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--app", default="poplar.cli.main:app", help="the typer app, module:attribute")
    ap.add_argument("--train-args", default=TRAIN_ARGS, help="the command's arguments ({plan}, {out} filled in)")
    ap.add_argument("--config-classes", default="TrainConfig,RunDescription,Run")
    ap.add_argument("--stop", default="Engine.train_batch", help="qualified name of the first step's function")
    ap.add_argument("--no-run", action="store_true", help="the static figures only")
    a = ap.parse_args()
    root = a.root.resolve()
    sys.path.insert(0, str(root))
    import poplar
    if not Path(poplar.__file__).resolve().is_relative_to(root):
        sys.exit(f"poplar was imported from {poplar.__file__}, not from {root}: run with PYTHONPATH={root}")
    table = floor_table(FLOORS[a.floors])
    tracer = None if a.no_run else trace_run(root, a.app, a.train_args, set(a.config_classes.split(",")), a.stop)
    report = {"root": str(root), "poplar_file": poplar.__file__, "floors": a.floors,
              "static": static_report(root, table), "path": path_report(tracer, table) if tracer else {}}
    show(report)
    if a.json:
        a.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
