"""The package flows one way: the imports inside ``powerlens/``, parsed with ``ast``.

The layer order (issue 9 §2, docs/design.md)::

    io         a leaf utility: imports no other powerlens module; anything may import it
    dynamics   imports only dynamics
    models     imports dynamics
    analysis   imports dynamics and models
    steering   imports dynamics, models and analysis
    reproduce, commands, cli   the top: may import anything below, and each other

``powerlens/__init__.py`` is the facade that re-exports the tour: it may import anything,
and only the top may import it (``import powerlens`` / ``from powerlens import name`` /
``from .. import name`` for a name that is not a module). Every import counts for the
layering, at module level or inside a function; absolute (``powerlens.x``) and relative
(``from ..x import``) alike. Besides the order:

* no cycle between the subpackages (every import, inside functions too);
* no cycle among the modules of one subpackage (module-level imports only: an import
  inside a function runs after every module has loaded; ``if TYPE_CHECKING:`` never runs).

Importing a submodule (``from . import params``, ``from .params import X``) needs that
module only; a name that is not a module (``from . import simulate_batch``) needs the
package's ``__init__``.
"""
from __future__ import annotations

import ast
import dataclasses
import os
import textwrap
from pathlib import Path
from typing import Dict, Iterable, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "powerlens"

TOP = 5
LEVELS = {"io": 0, "dynamics": 1, "models": 2, "analysis": 3, "steering": 4,
          "reproduce": TOP, "commands": TOP, "cli": TOP, "sweeps": TOP}
FACADE = "__init__"           # the unit of the package's own __init__.py


@dataclasses.dataclass(frozen=True)
class Import:
    source: str               # importing module, e.g. powerlens.dynamics.simulate
    file: str                 # its path relative to the repository root
    line: int
    target: str               # the imported powerlens module, e.g. powerlens.analysis.spectra
    module_level: bool        # runs when the module is imported (not in a function / TYPE_CHECKING)

    def where(self) -> str:
        return f"{self.file}:{self.line} -> {self.target}"


def _modules(pkg_dir: Path, pkg: str) -> Dict[str, Path]:
    """Every module of the package: dotted name -> file (a package is its __init__.py)."""
    out = {}
    for path in sorted(pkg_dir.rglob("*.py")):
        rel = path.relative_to(pkg_dir).with_suffix("")
        parts = [pkg] + list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
           (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterable[Tuple[ast.stmt, bool]]:
    """(Import/ImportFrom node, runs at module import time), everywhere in the tree."""
    def walk(node, module_level):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, module_level
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), False)
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), module_level)
            else:                                  # class bodies, if/try/with blocks run at import
                yield from walk(child, module_level)
    yield from walk(tree, True)


def collect(pkg_dir: Path, pkg: str = PACKAGE, root: Path = None) -> Tuple[Dict[str, Path], List[Import]]:
    """The package's modules and every import of one of them, resolved to a module name."""
    root = pkg_dir.parent if root is None else root
    modules = _modules(pkg_dir, pkg)
    imports = []
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        here = name if is_pkg else name.rpartition(".")[0]          # the package `from .` means
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        rel = os.path.relpath(path, root)
        for node, module_level in _import_nodes(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    parts = here.split(".")
                    if node.level - 1 >= len(parts):
                        raise AssertionError(f"{rel}:{node.lineno}: relative import beyond the package")
                    base = ".".join(parts[:len(parts) - (node.level - 1)])
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in modules else base)
            for t in dict.fromkeys(targets):            # `from .x import a, b`: one import of x
                if t == pkg or t.startswith(pkg + "."):
                    imports.append(Import(name, rel, node.lineno, t, module_level))
    return modules, imports


def unit_of(module: str) -> str:
    """The layer unit of a module: its subpackage, a root module's own name, or the facade."""
    parts = module.split(".")
    return FACADE if len(parts) == 1 else parts[1]


def violations(imports: Iterable[Import]) -> List[str]:
    """Every import against the layer order, as 'file:line -> module (why)'."""
    below = lambda u: sorted(v for v, lv in LEVELS.items() if lv < LEVELS[u] or v == u or v == "io")
    bad = []
    for imp in imports:
        src, tgt = unit_of(imp.source), unit_of(imp.target)
        if src == tgt or src == FACADE or tgt == "io":
            continue
        if src not in LEVELS:
            bad.append(f"{imp.where()}  ({src!r} has no place in the layer order)")
        elif src == "io":
            bad.append(f"{imp.where()}  (io is a leaf: it imports no other powerlens module)")
        elif tgt == FACADE:
            if LEVELS[src] != TOP:
                bad.append(f"{imp.where()}  (the {PACKAGE} facade __init__ is imported only by "
                           f"reproduce/commands/cli; {src} may import only: {', '.join(below(src))})")
        elif tgt not in LEVELS:
            bad.append(f"{imp.where()}  ({tgt!r} has no place in the layer order)")
        elif LEVELS[tgt] > LEVELS[src]:
            bad.append(f"{imp.where()}  (upward: {src} may import only: {', '.join(below(src))})")
    return sorted(bad)


def cycles(edges: Dict[str, Dict[str, List[Import]]]) -> List[str]:
    """Strongly connected components of more than one node (Tarjan), each with the imports
    that close it: 'a -> b -> a: file:line -> module; ...'."""
    nodes = sorted(set(edges) | {b for a in edges for b in edges[a]})
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, {})):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in nodes:
        if v not in index:
            strong(v)
    msgs = []
    for comp in sorted(out):
        inside = set(comp)
        wheres = [imp.where() for a in comp for b in sorted(edges.get(a, {})) if b in inside
                  for imp in edges[a][b]]
        msgs.append(f"cycle among {', '.join(comp)}:\n    " + "\n    ".join(wheres))
    return msgs


def unit_graph(imports: Iterable[Import]) -> Dict[str, Dict[str, List[Import]]]:
    g: Dict[str, Dict[str, List[Import]]] = {}
    for imp in imports:
        a, b = unit_of(imp.source), unit_of(imp.target)
        if a != b:
            g.setdefault(a, {}).setdefault(b, []).append(imp)
    return g


def module_graph(imports: Iterable[Import], unit: str) -> Dict[str, Dict[str, List[Import]]]:
    """The module-level imports between the modules of one unit."""
    g: Dict[str, Dict[str, List[Import]]] = {}
    for imp in imports:
        if imp.module_level and unit_of(imp.source) == unit == unit_of(imp.target) \
                and imp.source != imp.target:
            g.setdefault(imp.source, {}).setdefault(imp.target, []).append(imp)
    return g


MODULES, IMPORTS = collect(ROOT / PACKAGE, PACKAGE, ROOT)
SUBPACKAGES = sorted({unit_of(m) for m, p in MODULES.items() if p.name == "__init__.py" and m != PACKAGE})


# ------------------------------------------------------------------------------ powerlens

def test_every_unit_has_a_place():
    units = {unit_of(m) for m in MODULES} - {FACADE}
    assert units <= set(LEVELS), f"modules outside the layer order: {sorted(units - set(LEVELS))}"
    assert {"dynamics", "models", "analysis", "steering"} <= set(SUBPACKAGES)


def test_imports_follow_the_layer_order():
    bad = violations(IMPORTS)
    assert not bad, f"{len(bad)} import(s) against the layer order:\n  " + "\n  ".join(bad)


def test_no_cycle_between_subpackages():
    found = cycles(unit_graph(IMPORTS))
    assert not found, "\n".join(found)


@pytest.mark.parametrize("unit", SUBPACKAGES)
def test_no_cycle_inside_a_subpackage(unit):
    found = cycles(module_graph(IMPORTS, unit))
    assert not found, "\n".join(found)


# ---------------------------------------------------------------- the checker on a fake tree

def _write(root: Path, files: Dict[str, str]):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")


def test_checker_finds_what_it_must(tmp_path):
    """Upward imports at module level, inside functions and methods, absolute and relative;
    the facade; io importing a subpackage; cycles between subpackages and among the modules
    of one; and what it must leave alone (io, submodules, TYPE_CHECKING, function-level
    imports in the module cycle check)."""
    _write(tmp_path, {
        "pkg/__init__.py": "from .dynamics.a import f\nfrom .steering.s import g\n",
        "pkg/io.py": "import json\nimport pkg.dynamics\n",                                   # io: leaf
        "pkg/dynamics/__init__.py": "from .a import f\n",
        "pkg/dynamics/a.py": """\
            import numpy as np
            from . import b                      # a submodule: fine
            from .. import io                    # io: fine
            def f():
                from ..analysis import spectra   # upward, inside a function
            """,
        "pkg/dynamics/b.py": """\
            from typing import TYPE_CHECKING
            from .a import f                     # a <-> b at module level: a cycle
            if TYPE_CHECKING:
                from .c import C                 # never runs: no edge for the cycle check
            class K:
                def m(self):
                    import pkg.models.x          # upward, inside a method
            """,
        "pkg/dynamics/c.py": "from . import b\n",
        "pkg/dynamics/d.py": "def h():\n    from . import e\n",
        "pkg/dynamics/e.py": "from . import d\n",      # d -> e only inside a function: no cycle
        "pkg/models/__init__.py": "",
        "pkg/models/x.py": "from ..dynamics import a\nfrom pkg.dynamics.b import K\n",
        "pkg/analysis/__init__.py": "",
        "pkg/analysis/spectra.py": "from ..models import x\nfrom pkg import io\n",
        "pkg/steering/__init__.py": "",
        "pkg/steering/s.py": "from pkg import f\ndef g():\n    from .. import f\n",       # the facade, twice
        "pkg/commands/__init__.py": "from ..reproduce import r\nfrom .. import f\n",
        "pkg/reproduce/__init__.py": "",
        "pkg/reproduce/r.py": "def run():\n    from ..commands import q\n",
        "pkg/commands/q.py": "",
    })
    modules, imports = collect(tmp_path / "pkg", "pkg", tmp_path)
    bad = violations(imports)
    got = {b.split("  (")[0] for b in bad}
    assert got == {
        os.path.join("pkg", "io.py") + ":2 -> pkg.dynamics",
        os.path.join("pkg", "dynamics", "a.py") + ":5 -> pkg.analysis.spectra",
        os.path.join("pkg", "dynamics", "b.py") + ":7 -> pkg.models.x",
        os.path.join("pkg", "steering", "s.py") + ":1 -> pkg",
        os.path.join("pkg", "steering", "s.py") + ":3 -> pkg",
    }, bad
    assert any("upward: dynamics may import only: dynamics, io" in b for b in bad)
    # cycles between units: steering <-> the facade that re-exports it; io <-> dynamics (and
    # with it the units dynamics imports upward); commands <-> reproduce (the second import
    # inside a function)
    unit_cycles = cycles(unit_graph(imports))
    assert [c.split(":")[0] for c in unit_cycles] == ["cycle among __init__, steering",
                                                      "cycle among analysis, dynamics, io, models",
                                                      "cycle among commands, reproduce"], unit_cycles
    assert os.path.join("pkg", "reproduce", "r.py") + ":2 -> pkg.commands.q" in unit_cycles[2]
    # a <-> b inside dynamics, and nothing else (c -> b -> c runs only under TYPE_CHECKING,
    # d -> e -> d only inside a function)
    mod_cycles = cycles(module_graph(imports, "dynamics"))
    assert len(mod_cycles) == 1 and mod_cycles[0].startswith("cycle among pkg.dynamics.a, pkg.dynamics.b:")
    assert not cycles(module_graph(imports, "models"))
    # `from pkg.dynamics.b import K` resolves to the module; `from . import b` to the submodule
    targets = {(i.source, i.target) for i in imports}
    assert ("pkg.models.x", "pkg.dynamics.b") in targets and ("pkg.dynamics.a", "pkg.dynamics.b") in targets
    assert ("pkg.dynamics", "pkg.dynamics.a") in targets
