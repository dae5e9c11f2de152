"""The runtime never needs torch: every user-facing command runs with torch made unimportable.

The suite itself runs with torch installed (it is the test oracle), which once hid that the
GGUF tokenizer went through transformers' torch-only GGUF reader. Here each command runs in a
fresh process whose ``sitecustomize`` (tests/no_torch/) makes torch look uninstalled, the way
a runtime-only install is; the same process reports at exit which torch modules it imported.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BLOCKER = os.path.join(os.path.dirname(__file__), "no_torch")

# each command once; the GGUF models (SmolLM2, Gemma 3: loading, the GGUF tokenizer, spectra,
# alignment and steering) go through `steer smollm2`, `align gemma3` and one of reproduce
# --quick's real-model sections, in its worker processes. Its synthetic sections (the sweep
# engine, no model) run without torch in test_reproduce.py's kill-and-resume test; the whole
# `make reproduce` runs in a venv without torch (README).
REAL_MODEL_SECTIONS = ["shared_real"]
COMMANDS = {
    "spectrum-minilm": ["spectrum", "minilm"],
    "align-minilm": ["align", "minilm", "--text", "The cat sat on the mat.", "--quiet"],
    "align-gemma3": ["align", "gemma3", "--text", "The cat sat on the mat.", "--quiet"],
    "steer-smollm2": ["steer", "smollm2", "--direction", "token:Paris", "--text", "The capital of France is",
                      "--target-alignment", "0.9", "--w", "value"],
    "reproduce-quick": ["reproduce", "--quick", "--sections", *REAL_MODEL_SECTIONS],
}
OUTPUTS = {"spectrum": "spectrum.json", "align": "align.json", "steer": "steer.json", "reproduce": "results.json"}


def without_torch(env=None) -> dict:
    """``env`` (default ``os.environ``) with the blocker first on PYTHONPATH: torch made
    unimportable in the process and in every process it starts."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (BLOCKER, env.get("PYTHONPATH", "")) if p)
    return env


def run_without_torch(args, out, timeout=600):
    env = without_torch()
    env.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)     # the command itself must silence the notice
    return subprocess.run([sys.executable, "-m", "powerlens.cli", *args, "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=timeout)


def test_the_blocker_blocks(tmp_path):
    """Sanity: under the hook torch cannot be imported and find_spec says it is absent."""
    env = dict(os.environ, PYTHONPATH=BLOCKER)
    code = ("import importlib.util as u\nassert u.find_spec('torch') is None\n"
            "try:\n    import torch\nexcept ModuleNotFoundError:\n    print('blocked')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "blocked"
    assert "NO-TORCH-CHECK: none" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMMANDS))
def test_command_runs_without_torch(name, tmp_path):
    args = COMMANDS[name]
    out = tmp_path / "out"
    r = run_without_torch(args, out)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    checks = [line for line in r.stderr.splitlines() if line.startswith("NO-TORCH-CHECK")]
    assert checks and set(checks) == {"NO-TORCH-CHECK: none"}, log[-3000:]   # in no process (workers too)
    if args[0] == "reproduce":
        assert len(checks) > 1                                       # its worker processes reported too
    assert "PyTorch was not found" not in log                        # the terminal stays clean
    doc = json.loads((out / OUTPUTS[args[0]]).read_text())
    assert doc
    if args[0] == "reproduce":
        verdicts = {s["id"]: s["verdict"] for s in doc["sections"]}
        assert "failed" not in verdicts.values(), verdicts
        assert list(verdicts) == REAL_MODEL_SECTIONS
