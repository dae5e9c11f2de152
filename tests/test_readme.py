"""The README stays true: its Python tour runs, and its commands exist."""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        return fh.read()


def test_python_tour_runs():
    block = re.search(r"```python\n(.*?)```", _readme(), re.S).group(1)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    # the tour's numbers: the synthetic system's top eigenvalue and a steered MiniLM layer
    assert abs(scope["spectra"][0].shifted.top - 2.0) < 1e-4
    assert scope["a"] > 0 and scope["steered"].delta_norm > 0


def test_documented_commands_exist():
    from powerlens.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    inside, lines = False, []
    for line in _readme().splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside:
            lines.append(line)
    names = re.findall(r"^powerlens (\w+)", "\n".join(lines), re.M)
    assert {"simulate", "spectrum", "align", "steer", "reproduce"} <= set(names)
    for name in names:
        assert name in sub.choices, name
    with open(os.path.join(ROOT, ".ci", "run")) as fh:
        ci = fh.read()
    assert "make test" in ci and "make test" in _readme()
