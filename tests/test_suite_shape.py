"""The suite's own shape: a test leans on poplar's public names, and on shared helpers, never on another test file.

- no module under tests/ imports a ``test_*.py`` module: what two test files share lives in ``tests/helpers/``
  (or a folder's helper module: ``profiles.py``, ``workers.py``: functions its spawned ranks run) or a fixture;
- no test reaches a ``_private`` name of poplar: not imported, not read or set on a module or an object
  (``monkeypatch.setattr`` included), not named in a patch target. Where a test needs the seam, the name is
  public.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
POPLAR = TESTS.parent / "poplar"
TARGET = re.compile(r"^poplar(\.\w+)*\._(?!_)\w*")     # "poplar.x._y": a patch's target


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module(path: Path) -> str:
    parts = path.relative_to(TESTS.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _sources() -> list[tuple[Path, ast.AST]]:
    return [(path.relative_to(TESTS.parent), ast.parse(path.read_text())) for path in sorted(TESTS.rglob("*.py"))]


def _imported_modules(tree: ast.AST, me: str) -> set[str]:
    """Every module ``tree`` imports (``from package import module`` is the module's), relative ones resolved."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = me.split(".")[:len(me.split(".")) - node.level] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.add(module)
            out.update(f"{module}.{a.name}" for a in node.names)
    return out


def test_no_module_of_the_suite_imports_a_test_file():
    test_files = {_module(p) for p in TESTS.rglob("test_*.py")}
    bad = [f"{path} imports {m}: move what both use to tests/helpers/" for path, tree in _sources()
           for m in sorted(_imported_modules(tree, _module(TESTS.parent / path)) & test_files)]
    assert not bad, "\n".join(bad)


def test_every_import_of_poplar_or_of_the_suite_names_a_module_there_is():
    """A module moved is imported from where it is now (an import inside a test fails only when the test runs)."""
    there = {_module(p) for root in (POPLAR, TESTS) for p in root.rglob("*.py")}
    bad = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            named = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            bad += [f"{path}: line {node.lineno}: imports {m}: no such module" for m in named
                    if m and m.split(".")[0] in ("poplar", "tests") and m not in there]
    assert not bad, "\n".join(bad)


def _private_names_of_poplar() -> set[str]:
    """Every private name poplar defines: functions, classes, methods, module names, attributes set."""
    names = set()
    for path in POPLAR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {n for n in names if _private(n)}


def _own_and_foreign(tree: ast.AST) -> tuple[set[str], set[str]]:
    """The private names a test file defines itself, and the names it binds to other packages' modules."""
    own, foreign = set(), {"self", "cls"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Import):
            foreign.update((a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("poplar"))
        elif isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("poplar"):
            foreign.update(a.asname or a.name for a in node.names)
    return own, foreign


def _root(node: ast.AST) -> str:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return getattr(node, "id", "")


def _private_uses(tree: ast.AST, poplar_private: set[str]) -> list[str]:
    own, foreign = _own_and_foreign(tree)
    theirs = (poplar_private - own).__contains__
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("poplar"):
            found += [(node.lineno, f"imports {a.name} from {node.module}") for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Attribute) and theirs(node.attr) and _root(node.value) not in foreign:
            found.append((node.lineno, f"reads {ast.unparse(node)}"))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("setattr", "delattr"):
            names = [a.value for a in node.args[1:2] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            found += [(node.lineno, f"sets {ast.unparse(node.args[0])}.{n}") for n in names if theirs(n)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and TARGET.match(node.value):
            found.append((node.lineno, f"names {node.value}"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_no_test_reaches_a_private_name_of_poplar():
    poplar_private = _private_names_of_poplar()
    bad = [f"{path}: {use}" for path, tree in _sources() for use in _private_uses(tree, poplar_private)]
    assert not bad, "a test reaches a private name of poplar (make the name public, or test through the public " \
                    "function that uses it):\n" + "\n".join(bad)
