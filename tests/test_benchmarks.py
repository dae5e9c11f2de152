"""The benchmark scripts run in their tiny configurations: in benchmarks/vs_torch.py powerlens and
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


@pytest.mark.slow
def test_gpu_script_runs_on_cpu(tmp_path):
    """benchmarks/gpu.py (workloads A-D, powerlens only) runs on whatever device JAX sees and
    writes a JSON of timings: every workload present, every time positive."""
    import json

    import gpu
    out = tmp_path / "t.json"
    doc = gpu.main(["--tiny", "--repeat", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert {r["workload"] for r in doc["results"]} == {"A", "B", "C", "D"}
    assert all(r["seconds"] > 0 for r in doc["results"])
    assert doc["platform"] == "cpu"
