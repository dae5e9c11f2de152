"""benchmarks/vs_torch.py runs in its tiny configuration, and in every workload powerlens and
the torch code agree (the numbers it times are the same computation). No timing is asserted."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


@pytest.mark.slow
def test_tiny_configuration_agrees_with_torch(capsys):
    import vs_torch
    lines = vs_torch.main(["--tiny", "--repeat", "1"])
    assert {x["workload"] for x in lines} == {"A", "B", "C", "D"}
    for x in lines:
        if "rel_err" in x:
            assert x["rel_err"] < 1e-5, x
        if "abs_err" in x:
            assert x["abs_err"] < 1e-3, x
        if "ratio" in x:
            assert x["ratio"] > 0
    assert "matmul 2048^3" in capsys.readouterr().out
