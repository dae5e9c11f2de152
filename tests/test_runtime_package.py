"""Process concerns live in ``powerlens/_src/runtime/`` alone (issue 44, item 4).

* No module outside ``runtime/`` sets the CPU affinity, a thread count (BLAS or XLA's
  intra-op threads), the compilation cache, or calls ``jax.distributed``: the source is
  parsed, and its code (not its docstrings or comments) searched for those calls.
* ``powerlens._src.runtime`` is imported only by the entry points: ``cli.py``, ``commands/`` and
  ``reproduce``'s worker entry point (``reproduce/workers.py``); runtime itself imports
  nothing above ``dynamics`` (and ``io``).
* Importing runtime imports no numerical library.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List

from test_layering import IMPORTS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "powerlens"
RUNTIME = PACKAGE / "_src" / "runtime"

# what a process concern looks like in code: names (attributes, imports) ...
NAMES = re.compile(r"\bsched_(set|get)affinity\b|\bjax\.distributed\b|\bthreadpool_limits\b|"
                   r"\bthreadpoolctl\b|\bjax\.experimental\.compilation_cache\b")
# ... and strings (environment variables, XLA flags, JAX options)
STRINGS = re.compile(r"(OPENBLAS|OMP|MKL|GOTO|VECLIB)_NUM_THREADS|multi_thread_eigen|intra_op|inter_op|"
                     r"compilation_cache|persistent_cache|cpu_collectives|POWERLENS_XLA_THREADS", re.IGNORECASE)

ENTRY_POINTS = ("powerlens.cli", "powerlens.distributed", "powerlens._src.commands", "powerlens._src.reproduce.workers", "powerlens._src.runtime")
RUNTIME_MAY_IMPORT = ("powerlens._src.io", "powerlens._src.dynamics.execution", "powerlens._src.runtime")


def _docstrings(tree: ast.AST) -> set:
    """ids of the string constants that are docstrings or other bare string statements."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def process_concerns(source: str, name: str = "<source>") -> List[str]:
    """'line: text' of every process-concern call or setting in ``source`` (code only)."""
    tree = ast.parse(source, filename=name)
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        texts = []
        if isinstance(node, ast.Attribute):
            texts = [ast.unparse(node)]
        elif isinstance(node, ast.Name):
            texts = [node.id]
        elif isinstance(node, ast.Import):
            texts = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            texts = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if STRINGS.search(node.value):
                found.append(f"{node.lineno}: {node.value[:60]!r}")
            continue
        found += [f"{node.lineno}: {t}" for t in texts if NAMES.search(t)]
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def test_the_checker_finds_what_it_must():
    """The calls that sat in sweeps/distributed.py, reproduce/workers.py and cli.py before."""
    old = '''
import os, jax
from threadpoolctl import threadpool_limits
"""A docstring may name OPENBLAS_NUM_THREADS, os.sched_setaffinity and jax.distributed."""
def start_xla():
    os.sched_setaffinity(0, {0})
    jax.distributed.initialize("127.0.0.1:1", 2, 0)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
def env():
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    flags = "--xla_cpu_multi_thread_eigen=false"
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/x")
    # a comment may name OMP_NUM_THREADS too
'''
    lines = {int(f.split(":")[0]) for f in process_concerns(old)}
    assert lines == {3, 6, 7, 8, 10, 11, 12}, process_concerns(old)
    assert process_concerns("from .runtime.cache import compilation_cache as _cache\n_cache()\n") == []


def test_no_process_concern_outside_runtime():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if RUNTIME in path.parents:
            continue
        rel = path.relative_to(ROOT)
        found += [f"{rel}:{f}" for f in process_concerns(path.read_text(encoding="utf-8"), str(rel))]
    assert not found, "process concerns outside powerlens/_src/runtime/:\n" + "\n".join(found)


def test_runtime_has_what_moved_there():
    """Each concern is in runtime (so the test above does not pass by their being gone)."""
    text = "".join(p.read_text(encoding="utf-8") for p in sorted(RUNTIME.glob("*.py")))
    for needle in ("os.sched_setaffinity", "jax.distributed.initialize", '"OPENBLAS_NUM_THREADS"',
                   "SINGLE_THREAD_XLA", "jax_compilation_cache_dir", "PR_SET_PDEATHSIG", "os.killpg"):
        assert needle in text, needle


def test_runtime_is_imported_by_the_entry_points_only():
    users = {imp.source for imp in IMPORTS if imp.target.startswith("powerlens._src.runtime")}
    strangers = sorted(u for u in users if not u.startswith(ENTRY_POINTS))
    assert not strangers, f"powerlens._src.runtime imported outside the entry points: {strangers}"
    assert {"powerlens.cli", "powerlens._src.commands.sweep", "powerlens._src.reproduce.workers"} <= users
    upward = sorted(imp.where() for imp in IMPORTS if imp.source.startswith("powerlens._src.runtime")
                    and not imp.target.startswith(RUNTIME_MAY_IMPORT))
    assert not upward, f"powerlens._src.runtime imports above dynamics: {upward}"


def test_importing_runtime_imports_no_numerical_library():
    code = ("import sys, powerlens._src.runtime.cache, powerlens._src.runtime.distributed, powerlens._src.runtime.threads, "
            "powerlens._src.runtime.workers, powerlens.distributed; "
            "assert powerlens.distributed.initialize is powerlens._src.runtime.distributed.initialize; "
            "print(sorted(m for m in ('jax', 'numpy', 'scipy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_reproduce_workers_start_from_the_users_environment(monkeypatch):
    """The command line asks for one XLA thread in reproduce's main process, and hands the
    environment from before that to the workers (no module state keeps it)."""
    from jax._src import xla_bridge
    from powerlens import cli
    from powerlens._src import reproduce
    from powerlens._src.runtime.threads import SINGLE_THREAD_XLA, XLA_THREADS
    monkeypatch.delenv(XLA_THREADS, raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_hlo_as_text")
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    seen = {}
    monkeypatch.setattr(reproduce, "cmd_reproduce", lambda args, worker_base_env: seen.update(worker_base_env) or 0)
    assert cli._reproduce(object()) == 0
    assert os.environ[XLA_THREADS] == "1" and os.environ["XLA_FLAGS"].endswith(SINGLE_THREAD_XLA)
    assert XLA_THREADS not in seen and seen["XLA_FLAGS"] == "--xla_dump_hlo_as_text"
