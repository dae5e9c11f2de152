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
  inside a function runs after every module has loaded; ``if TYPE_CHECKING:`` never runs);
* no cycle between any two modules of the package counting every import that runs, inside
  functions too (only ``if TYPE_CHECKING:`` is left out): a function-level import hides a
  cycle from the import machinery, not from the design. The one exception is the converter
  registry (:data:`REGISTRY`).

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
LEVELS = {"_src": 0, "io": 0, "lazy": 0, "dynamics": 1, "models": 2, "analysis": 3, "steering": 4,
          "reproduce": TOP, "commands": TOP, "cli": TOP, "distributed": TOP, "sweeps": TOP,
          "runtime": TOP}           # process concerns; who may import it: tests/test_runtime_package.py
FACADE = "__init__"           # the unit of the package's own __init__.py
PRIVATE = "_src"              # the implementation package: every module but the facade and cli


@dataclasses.dataclass(frozen=True)
class Import:
    source: str               # importing module, e.g. powerlens._src.dynamics.simulate
    file: str                 # its path relative to the repository root
    line: int
    target: str               # the imported powerlens module, e.g. powerlens._src.analysis.spectra
    module_level: bool        # runs when the module is imported (not in a function / TYPE_CHECKING)
    runs: bool = True         # runs at all: False only under ``if TYPE_CHECKING:``

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


def _import_nodes(tree: ast.AST) -> Iterable[Tuple[ast.stmt, bool, bool]]:
    """(Import/ImportFrom node, runs at module import time, runs at all), everywhere in the
    tree (``if TYPE_CHECKING:`` never runs)."""
    def walk(node, module_level, runs):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, module_level, runs
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, False, runs)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), False, False)
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), module_level, runs)
            else:                                  # class bodies, if/try/with blocks run at import
                yield from walk(child, module_level, runs)
    yield from walk(tree, True, True)


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
        for node, module_level, runs in _import_nodes(tree):
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
                    imports.append(Import(name, rel, node.lineno, t, module_level, runs))
    return modules, imports


def unit_of(module: str) -> str:
    """The layer unit of a module: its subpackage, a root module's own name, or the facade.
    The private implementation package ``_src`` is transparent: ``powerlens._src.dynamics.run``
    is in ``dynamics``; ``powerlens._src`` itself (a docstring, no imports) is a leaf."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] == PRIVATE:
        parts = parts[1:]
    return FACADE if len(parts) == 1 else parts[1]


def violations(imports: Iterable[Import]) -> List[str]:
    """Every import against the layer order, as 'file:line -> module (why)'."""
    below = lambda u: sorted(v for v, lv in LEVELS.items() if (lv < LEVELS[u] or v == u or v == "io") and v != PRIVATE)
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


def runtime_graph(imports: Iterable[Import], allowed: Iterable[Tuple[str, str]] = ()
                  ) -> Dict[str, Dict[str, List[Import]]]:
    """Every import that runs (at module level or inside a function; not under
    ``TYPE_CHECKING``) between two modules, but the ``allowed`` (source, target) edges."""
    allowed = set(allowed)
    g: Dict[str, Dict[str, List[Import]]] = {}
    for imp in imports:
        if imp.runs and imp.source != imp.target and (imp.source, imp.target) not in allowed:
            g.setdefault(imp.source, {}).setdefault(imp.target, []).append(imp)
    return g


REGISTRY = {("powerlens._src.models.layout", "powerlens._src.models.families")}
"""The converter registry, the one cycle the package keeps. ``models/families.py`` imports
every family module so that each converter registers itself (``@register`` in
``models/base.py``) with its output-projection layout; each family module imports
``models/layout.py`` for those layouts (LINEAR, CONV1D); and ``layout.output_layout`` imports
``families`` inside the function, so that every family has registered before the table is
read. A registry filled by its members' imports is the point of the pattern (a new family is
one module and one line in ``families.py``), and the import runs only at call time, after
every module has loaded. This edge closes that cycle and is the only import left out."""

KNOWN_CYCLES: Set[frozenset] = set()
"""Cycles that are known and being removed (frozensets of module names), each deleted here
when it is gone: the test fails on a stale entry. Empty: the last one,
``steering/optimize <-> steering/token``, went with ``steering/edits.py`` (issue 44, item 2)."""

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


def _cycle_modules(msg: str) -> frozenset:
    return frozenset(msg.split(":", 1)[0][len("cycle among "):].split(", "))


def test_no_cycle_between_modules_counting_function_level_imports():
    """Every import that runs, inside functions too, between any two modules of the package:
    no cycle but the converter registry (:data:`REGISTRY`) and the :data:`KNOWN_CYCLES`."""
    found = cycles(runtime_graph(IMPORTS, REGISTRY))
    new = [c for c in found if _cycle_modules(c) not in KNOWN_CYCLES]
    assert not new, f"{len(new)} import cycle(s) between modules:\n" + "\n".join(new)
    stale = KNOWN_CYCLES - {_cycle_modules(c) for c in found}
    assert not stale, f"no longer a cycle, delete it from KNOWN_CYCLES: {sorted(map(sorted, stale))}"


def test_the_registry_is_the_cycle_it_names():
    """The exception is real and is the registry: its edge is a function-level import of
    ``families``, and with it the cycle runs through families, layout and the converters."""
    edges = [imp for imp in IMPORTS if (imp.source, imp.target) in REGISTRY]
    assert edges and all(imp.runs and not imp.module_level for imp in edges), edges
    with_registry = [_cycle_modules(c) for c in cycles(runtime_graph(IMPORTS))]
    registry = [c for c in with_registry if "powerlens._src.models.families" in c]
    assert len(registry) == 1 and {"powerlens._src.models.layout", "powerlens._src.models.llama"} <= registry[0], with_registry


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
    # counting every import that runs: d <-> e (inside a function) is a cycle; c -> b -> c
    # (TYPE_CHECKING) is not; an allowed edge takes its cycle out
    every = [_cycle_modules(c) for c in cycles(runtime_graph(imports))]
    assert frozenset({"pkg.dynamics.d", "pkg.dynamics.e"}) in every, every
    assert not any("pkg.dynamics.c" in c for c in every), every
    assert any({"pkg.dynamics.a", "pkg.dynamics.b", "pkg.models.x"} <= c for c in every), every
    fewer = [_cycle_modules(c) for c in cycles(runtime_graph(imports, {("pkg.dynamics.d", "pkg.dynamics.e")}))]
    assert frozenset({"pkg.dynamics.d", "pkg.dynamics.e"}) not in fewer and len(fewer) == len(every) - 1, fewer
