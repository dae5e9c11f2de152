"""`powerlens._src.runtime.figures.FigureProcess`: the figures of a command drawn by a child forked
before JAX starts, with the same files as drawing them in the command's own process."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

PROBE = r'''
import json, os, sys
from powerlens._src.runtime.figures import FigureProcess
from figure_jobs import write, fail
out = sys.argv[1]
report = {}
with FigureProcess(["json"]) as f:                     # no JAX imported: a child
    report["child"] = f.pid is not None and f.pid != os.getpid()
    f.draw(write, os.path.join(out, "a.txt"), "drawn", pid=True)
    f.wait()
report["written_by_child"] = open(os.path.join(out, "a.txt")).read() not in ("", str(os.getpid()))
try:
    with FigureProcess(["json"]) as f:
        f.draw(fail, "no such colormap")
        f.wait()
except RuntimeError as exc:
    report["error"] = str(exc)
try:
    with FigureProcess(["json"]) as f:
        pid = f.pid
        raise KeyError("before drawing")
except KeyError:
    pass
try:
    os.waitpid(pid, os.WNOHANG)
    report["reaped"] = False
except ChildProcessError:
    report["reaped"] = True
import jax  # noqa: F401                               # JAX imported: no fork, drawn here
with FigureProcess(["json"]) as f:
    report["local"] = f.pid is None
    f.draw(write, os.path.join(out, "b.txt"), "here", pid=True)
    f.wait()
report["b"] = open(os.path.join(out, "b.txt")).read() == str(os.getpid())
print(json.dumps(report))
'''


def test_a_child_draws_reports_its_errors_and_is_reaped(tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout.splitlines()[-1])
    assert report == {"child": True, "written_by_child": True,
                      "error": "drawing the figures failed: ValueError: no such colormap",
                      "reaped": True, "local": True, "b": True}, report


def test_align_draws_the_same_figure_in_a_child_as_in_process(tmp_path):
    """`powerlens align` in a fresh process (the figure drawn by the forked child) and
    in-process after JAX was imported (drawn here): the same align.json numbers and the same
    PNG (same size, pixels within one level on at most 0.1 % of them)."""
    from powerlens._src.models.load import resolve
    try:
        resolve("minilm")
    except ValueError:
        pytest.skip("MiniLM is not installed")
    args = ["align", "minilm", "--text", "The cat sat on the mat.", "--quiet"]
    r = subprocess.run([sys.executable, "-m", "powerlens.cli", *args, "--out", str(tmp_path / "child")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    import jax  # noqa: F401
    from powerlens.cli import main
    assert main([*args, "--out", str(tmp_path / "here")]) == 0
    docs = [json.loads((tmp_path / f / "align.json").read_text()) for f in ("child", "here")]
    for d in docs:                  # the spectra's float64 eig may differ in its last bits between processes
        d["settings"].pop("versions", None)
        d["settings"].pop("out", None)
        d.pop("layers")
    np.testing.assert_allclose(_numbers(docs[0]), _numbers(docs[1]), rtol=1e-6, atol=1e-7)
    import matplotlib.image as mpimg
    a, b = (mpimg.imread(tmp_path / f / "alignment.png") for f in ("child", "here"))
    assert a.shape == b.shape and np.mean(np.abs(a - b) > 1 / 255) < 1e-3


def _numbers(doc):
    """Every number of a JSON document, in order (None and text left out)."""
    if isinstance(doc, dict):
        return [x for k in sorted(doc) for x in _numbers(doc[k])]
    if isinstance(doc, list):
        return [x for v in doc for x in _numbers(v)]
    if isinstance(doc, bool) or not isinstance(doc, (int, float)):
        return []
    return [float(doc)]
