"""The results file each benchmark writes: ``docs/benchmarks/NAME.md`` for ``benchmarks/NAME.py``.

A benchmark run as a script replaces its file with what that one run measured:

    # benchmarks/NAME.py
    <one line on what it measures>
    - command: `python benchmarks/NAME.py ARGS`
    - date: YYYY-MM-DD
    - CPU: <model name>, N cores   (and the accelerator, when JAX sees one)
    - versions: Python, jax, jaxlib, numpy, powerlens, ... (the packages the script names)

    <its Markdown tables>

    <everything it printed, in a text block>

The README quotes some of these tables. A quoted table sits right after a marker line

    <!-- table from docs/benchmarks/NAME.md -->

and :func:`write` replaces it with the new file's first table, so the README and the file
never disagree (``tests/test_readme.py`` checks it). Paths of the machine the run happened
on (the checkout, the home and temporary folders) are written as ``<repo>``, ``~`` and
``<tmp>``.

Typical use, in a benchmark's ``main``::

    ap = argparse.ArgumentParser(...)
    benchdoc.add_doc_option(ap, "simulate")
    args = ap.parse_args(argv)
    with benchdoc.Capture() as printed:
        ...                                          # the benchmark, printing as it goes
    benchdoc.write_if_asked(args, "simulate", argv, [table], printed.text)
"""
from __future__ import annotations

import argparse
import importlib.metadata
import io
import os
import platform
import re
import sys
import tempfile
import time
from typing import Iterable, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DOCS = os.path.join(ROOT, "docs", "benchmarks")
README = os.path.join(ROOT, "README.md")

PACKAGES = ("jax", "jaxlib", "numpy", "powerlens")
"""The versions every header lists; a script adds its own (torch, transformers, ...)."""

MARKER = re.compile(r"^<!-- table from (docs/benchmarks/[\w.-]+\.md) -->$", re.M)
"""The README line that says the table below it is copied from a results file."""


def doc_path(name: str) -> str:
    """``docs/benchmarks/NAME.md`` of the checkout."""
    return os.path.join(DOCS, f"{name}.md")


# ------------------------------------------------------------------ the header

def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's processor name elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def versions(packages: Iterable[str] = ()) -> str:
    """"Python 3.x, jax x, ...": the interpreter and each installed package of
    :data:`PACKAGES` + ``packages`` (read from the installed metadata, nothing imported)."""
    out = [f"Python {platform.python_version()}"]
    for pkg in dict.fromkeys((*PACKAGES, *packages)):
        try:
            out.append(f"{pkg} {importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(out)


def command_line(script: str, argv: Optional[Sequence[str]]) -> str:
    """``python benchmarks/NAME.py ARGS`` as it was run (``sys.argv`` when ``argv`` is None)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python", f"benchmarks/{script}.py", *args])


def header(script: str, argv: Optional[Sequence[str]], *, summary: str = "",
           packages: Iterable[str] = (), accelerator: str = "") -> List[str]:
    """The file's first lines: its title, ``summary``, the command, the date, the CPU (and
    ``accelerator`` when given) and the versions."""
    lines = [f"# benchmarks/{script}.py", ""]
    if summary:
        lines += [summary, ""]
    lines += [f"- command: `{command_line(script, argv)}`",
              f"- date: {time.strftime('%Y-%m-%d')}",
              f"- CPU: {cpu_name()}, {os.cpu_count()} cores"]
    if accelerator:
        lines.append(f"- accelerator: {accelerator}")
    lines.append(f"- versions: {versions(packages)}")
    return lines


# ------------------------------------------------------------------ tables

def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> List[str]:
    """A Markdown table: the header, the rule, one line per row (cells as ``str``; ``None``
    becomes "–")."""
    cell = lambda v: "–" if v is None else str(v).replace("|", "\\|")
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"a table row has {len(row)} cells for {len(columns)} columns: {row!r}")
        out.append("| " + " | ".join(cell(v) for v in row) + " |")
    return out


def first_table(text: str) -> List[str]:
    """The first Markdown table of ``text`` (its consecutive lines that start with ``|``),
    or [] if it has none."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    if start is None:
        return []
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return lines[start:end]


def quoted_tables(text: str):
    """[(file, (first, last) line indices of the quoted table)] of every marker in ``text``:
    the table is the block of ``|`` lines right after the marker (empty when there is none)."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if m:
            end = i + 1
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            out.append((m.group(1), (i + 1, end)))
    return out


def sync_readme(doc_rel: str, table: Sequence[str], readme: str = README) -> bool:
    """Put ``table`` in place of every README table quoted from ``doc_rel``
    (``docs/benchmarks/NAME.md``); True when the README changed."""
    try:
        with open(readme, encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        return False
    lines = text.splitlines()
    for name, (a, b) in reversed(quoted_tables(text)):
        if name == doc_rel:
            lines[a:b] = list(table)
    new = "\n".join(lines) + ("\n" if text.endswith("\n") else "")
    if new == text:
        return False
    _replace(readme, new)
    return True


# ------------------------------------------------------------------ writing

def scrub(text: str) -> str:
    """``text`` with this machine's checkout, temporary and home folders written as
    ``<repo>``, ``<tmp>`` and ``~``, so that no file holds a path of the machine it was
    written on."""
    pairs = [(os.path.realpath(ROOT), "<repo>"), (ROOT, "<repo>"),
             (os.path.realpath(tempfile.gettempdir()), "<tmp>"), (tempfile.gettempdir(), "<tmp>"),
             (os.path.expanduser("~"), "~")]
    for path, name in sorted(pairs, key=lambda p: -len(p[0])):
        if len(path) > 1:
            text = text.replace(path, name)
    return text


def render(script: str, argv: Optional[Sequence[str]], tables: Sequence[Sequence[str]], printed: str, *,
           summary: str = "", packages: Iterable[str] = (), accelerator: str = "",
           notes: Sequence[str] = ()) -> str:
    """The whole results file (see the module docstring)."""
    lines = header(script, argv, summary=summary, packages=packages, accelerator=accelerator)
    for table in tables:
        lines += [""] + list(table)
    for note in notes:
        lines += ["", note]
    lines += ["", "Printed output:", "", "```text", *printed.rstrip("\n").splitlines(), "```", ""]
    return scrub("\n".join(lines))


def write(script: str, argv: Optional[Sequence[str]], tables: Sequence[Sequence[str]], printed: str, *,
          path: Optional[str] = None, readme: str = README, **kw) -> str:
    """Write (replace) the results file of ``benchmarks/SCRIPT.py`` (``path``, by default
    ``docs/benchmarks/SCRIPT.md``); when it is that default file, also the README table quoted
    from it. Returns the path. ``kw``: :func:`render`'s ``summary``, ``packages``,
    ``accelerator`` and ``notes``."""
    path = path or doc_path(script)
    text = render(script, argv, tables, printed, **kw)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    _replace(path, text)
    print(f"wrote {scrub(os.path.abspath(path))}")
    rel = f"docs/benchmarks/{script}.md"
    if tables and os.path.abspath(path) == os.path.abspath(doc_path(script)) and \
            sync_readme(rel, first_table(text), readme):
        print(f"updated the README's table quoted from {rel}")
    return path


def _replace(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a sibling temporary file, then ``os.replace``)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


# ------------------------------------------------------------------ the scripts' side

def add_doc_option(ap: argparse.ArgumentParser, script: str) -> None:
    """``--doc PATH`` (default ``docs/benchmarks/SCRIPT.md``; a ``--tiny``/``--quick`` run
    writes none unless given one) and ``--no-doc``."""
    ap.add_argument("--doc", default=None, metavar="PATH",
                    help=f"where to write the results file (default docs/benchmarks/{script}.md; "
                         "the tiny configurations write none unless given this)")
    ap.add_argument("--no-doc", action="store_true", help="write no results file")


def doc_target(args: argparse.Namespace, script: str) -> Optional[str]:
    """The results file this run writes, or None (``--no-doc``; a tiny run without ``--doc``)."""
    if args.no_doc:
        return None
    if args.doc:
        return args.doc
    if getattr(args, "tiny", False) or getattr(args, "quick", False):
        return None
    return doc_path(script)


def write_if_asked(args: argparse.Namespace, script: str, argv: Optional[Sequence[str]],
                   tables: Sequence[Sequence[str]], printed: str, **kw) -> Optional[str]:
    """:func:`write` to :func:`doc_target`, if there is one."""
    path = doc_target(args, script)
    return write(script, argv, tables, printed, path=path, **kw) if path else None


class Capture:
    """A context that keeps a copy of everything printed to stdout while it is open, and
    still prints it (``.text`` after or during the block)."""

    def __init__(self):
        self._buffer = io.StringIO()
        self._stdout = None

    def write(self, s: str) -> int:
        self._buffer.write(s)
        return self._stdout.write(s)

    def flush(self) -> None:
        self._stdout.flush()

    def __getattr__(self, name):                  # isatty, encoding, fileno, ...
        return getattr(self._stdout, name)

    @property
    def text(self) -> str:
        return self._buffer.getvalue()

    def __enter__(self) -> "Capture":
        self._stdout, sys.stdout = sys.stdout, self
        return self

    def __exit__(self, *exc) -> None:
        sys.stdout = self._stdout
