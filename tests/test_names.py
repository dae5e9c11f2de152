"""Each name means one thing, and no private name crosses a module boundary (issue 44, item 6),
checked on the source of ``powerlens/`` with ``ast``.

* A private name (``_x``, not a dunder) is used only in the module that defines it: no
  ``from .mod import _x`` and no ``mod._x`` for another powerlens module ``mod``. A helper two
  modules share is public, with a docstring.
* A public module-level function name is defined in one module, or the definitions are the
  same (a re-export is an import, not a second ``def``). :data:`SAME_NAME` lists the names
  that may repeat, each with the reason.
"""
from __future__ import annotations

import ast
import collections
import textwrap
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "powerlens"


def _modules(pkg_dir: Path, pkg: str) -> Dict[str, Path]:
    out = {}
    for path in sorted(pkg_dir.rglob("*.py")):
        parts = [pkg] + list(path.relative_to(pkg_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _base(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The module an ``ImportFrom`` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    here = (module if path.name == "__init__.py" else module.rpartition(".")[0]).split(".")
    base = ".".join(here[:len(here) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def private_crossings(pkg_dir: Path, pkg: str = PACKAGE) -> List[Tuple[str, str, str]]:
    """(importing module, defining module, private name) for every private name of one package
    module used in another: ``from mod import _x`` and ``mod._x`` (``mod`` bound by an import)."""
    modules = _modules(pkg_dir, pkg)
    out = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        bound = {}                                  # local name -> the package module it names
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _base(name, path, node)
                if base != pkg and not base.startswith(pkg + "."):
                    continue
                for a in node.names:
                    if f"{base}.{a.name}" in modules:
                        bound[a.asname or a.name] = f"{base}.{a.name}"
                    elif _private(a.name) and base != name:
                        out.append((name, base, a.name))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in modules:
                        bound[a.asname] = a.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr):
                target = bound.get(node.value.id)
                if target is not None and target != name:
                    out.append((name, target, node.attr))
    return sorted(set(out))


def function_names(pkg_dir: Path, pkg: str = PACKAGE) -> Dict[str, Dict[str, str]]:
    """Public module-level function name -> {module: its body (``ast.dump``, no positions)}."""
    out: Dict[str, Dict[str, str]] = collections.defaultdict(dict)
    for name, path in _modules(pkg_dir, pkg).items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                out[node.name][name] = ast.dump(ast.Module(body=node.body, type_ignores=[]))
    return out


def homonyms(names: Dict[str, Dict[str, str]]) -> Dict[str, List[str]]:
    """Names defined in two or more modules with different bodies -> the modules."""
    return {n: sorted(where) for n, where in names.items() if len(where) > 1 and len(set(where.values())) > 1}


PRIVATE_ALLOWED: set = set()
"""(user module, defining module, private name) crossings allowed: none. Add one only with its
reason; the test fails on a stale entry."""

SAME_NAME = {
    # one job, done once for each command's own report or folder:
    "render_html": "the HTML report of a sweep (sweeps/report) and of reproduce (reproduce/report)",
    "prepare_folder": "the output folder made ready by `sweep` (sweeps/store) and by `reproduce`",
    "check": "commands/budget.check is the commands' view of analysis/budget.check: the same "
             "refusal, with the memory available looked up where a test can replace it",
    # one meaning, two implementations (a twin to merge, not a homonym): models/reader.py is
    # NumPy-only and does not import dynamics/params.py, which imports JAX
    "all_finite": "whether every value of an array is finite, checked in chunks (models/reader, dynamics/params)",
}


# ------------------------------------------------------------------------------ powerlens

def test_no_private_name_crosses_a_module():
    found = set(private_crossings(ROOT / PACKAGE))
    new = sorted(found - PRIVATE_ALLOWED)
    assert not new, "private names used outside their module (make the helper public):\n  " + \
        "\n  ".join(f"{a} uses {b}.{n}" for a, b, n in new)
    stale = sorted(PRIVATE_ALLOWED - found)
    assert not stale, f"no longer crossing, delete from PRIVATE_ALLOWED: {stale}"


def test_each_public_function_name_means_one_thing():
    found = homonyms(function_names(ROOT / PACKAGE))
    new = {n: w for n, w in found.items() if n not in SAME_NAME}
    assert not new, "one name, different functions (rename one to say what it is):\n  " + \
        "\n  ".join(f"{n}: {', '.join(w)}" for n, w in sorted(new.items()))
    stale = sorted(set(SAME_NAME) - set(found))
    assert not stale, f"no longer defined twice, delete from SAME_NAME: {stale}"


def test_the_renamed_homonyms_are_gone():
    """The five homonyms of issue 44 each name one function now (the other was renamed)."""
    names = function_names(ROOT / PACKAGE)
    for name in ("host_matrices", "synthetic", "alignment", "check_steps", "worker_env"):
        assert len(names.get(name, {})) <= 1, (name, sorted(names.get(name, {})))


# ---------------------------------------------------------------- the checkers on a fake tree

def _write(root: Path, files: Dict[str, str]):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")


def test_checkers_find_what_they_must(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "__version__ = '1'\n",
        "pkg/io.py": "def _atomic(p):\n    return p\ndef write(p):\n    return _atomic(p)\n",
        "pkg/a/__init__.py": "from .b import _hidden\n",                   # package -> its module: crosses
        "pkg/a/b.py": """\
            from .. import io
            from ..io import write, _atomic          # crosses
            from pkg import __version__              # a dunder: fine
            def _hidden():
                return io._atomic("x")               # crosses, as an attribute
            def run(x):
                from . import c
                return c._inner(x) + _hidden()       # crosses inside a function; _hidden is its own
            """,
        "pkg/a/c.py": "import pkg.io as pio\ndef _inner(x):\n    return pio._atomic(x)\ndef run(x):\n    return x\n",
        "pkg/a/d.py": "def write(p):\n    return p\n",               # same name as io.write, other body
        "pkg/a/e.py": "def run(x):\n    return x\n",                # same body as c.run: not a homonym
    })
    got = private_crossings(tmp_path / "pkg", "pkg")
    assert got == [("pkg.a", "pkg.a.b", "_hidden"), ("pkg.a.b", "pkg.a.c", "_inner"),
                   ("pkg.a.b", "pkg.io", "_atomic"), ("pkg.a.c", "pkg.io", "_atomic")], got
    found = homonyms(function_names(tmp_path / "pkg", "pkg"))
    assert found == {"write": ["pkg.a.d", "pkg.io"], "run": ["pkg.a.b", "pkg.a.c", "pkg.a.e"]}, found
