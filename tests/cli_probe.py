"""Command lines of ``powerlens`` run one after the other in one fresh process, each reported
with its exit status, its standard-error lines and the heavy modules loaded by then."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Tuple

_PROBE = """
import contextlib, io, json, sys
from powerlens.cli import main
heavy = json.loads(sys.argv[2])
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            status = main(argv.split())
        except SystemExit as exc:
            status = exc.code
    print(json.dumps([argv, status, err.getvalue().strip().splitlines(), sorted(m for m in heavy if m in sys.modules)]))
"""


def probe(argvs: Sequence[str], heavy: Sequence[str], cwd=None, env: Optional[dict] = None,
          timeout: int = 120) -> Dict[str, Tuple[int, List[str], List[str]]]:
    """argv -> (exit status, stderr lines, the modules of ``heavy`` imported after it). The
    process runs them in order, so a module reported after one case may come from an earlier one."""
    env = dict(os.environ if env is None else env, OPENBLAS_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(list(argvs)), json.dumps(list(heavy))],
                       capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return {argv: (status, lines, mods) for argv, status, lines, mods in map(json.loads, r.stdout.splitlines())}
