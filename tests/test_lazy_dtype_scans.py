"""The cases of tests/lazy_dtype_scans_cases.py (one-layer upcasts in generate's scans, the LM
head and trace, counted from compiled programs' temporary bytes), run in a fresh pytest
process: XLA's CPU compiler (jaxlib 0.10.2) crashed three times compiling these bf16 programs
in a long-lived test worker that had compiled many programs before, never in a fresh process."""
from __future__ import annotations

import os
import subprocess
import sys


def test_the_cases_pass_in_a_fresh_process():
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        os.path.join(here, "lazy_dtype_scans_cases.py")], capture_output=True, text=True,
                       cwd=os.path.dirname(here), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "5 passed" in r.stdout.splitlines()[-1], r.stdout[-500:]
