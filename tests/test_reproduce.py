"""`powerlens reproduce`: resumable after a real kill, deterministic, failures isolated."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from powerlens import reproduce
from powerlens.reproduce.section import SectionResult

SECTIONS = ["bipartite"]


def _cmd(out):
    return [sys.executable, "-m", "powerlens.cli", "reproduce", "--quick", "--out", str(out), "--sections", *SECTIONS]


def _chunks(out):
    root = os.path.join(out, ".chunks")
    return [f for _, _, fs in os.walk(root) for f in fs if f.endswith(".json")]


@pytest.mark.slow
def test_resume_after_kill_gives_identical_results(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(killed), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 240
    while len(_chunks(killed)) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(_chunks(killed))
    assert done_before >= 3
    assert not (killed / "results.json").exists()

    resumed = subprocess.run(_cmd(killed), capture_output=True, text=True, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    n_resumed = int(resumed.stdout.split(" chunks resumed")[0].rsplit("(", 1)[1])
    assert n_resumed >= done_before

    fresh = tmp_path / "fresh"
    clean = subprocess.run(_cmd(fresh), capture_output=True, text=True, env=env, timeout=600)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert (killed / "results.json").read_bytes() == (fresh / "results.json").read_bytes()
    assert not (fresh / ".chunks").exists()              # finished runs clean up their chunks
    doc = json.loads((fresh / "results.json").read_text())
    assert [s["id"] for s in doc["sections"]] == ["bipartite"]
    assert "files written:" in clean.stdout and "report.html" in clean.stdout


def test_failing_section_is_reported_and_others_kept(tmp_path, monkeypatch, capsys):
    def good(ctx):
        return SectionResult("good", "Good section", "claim", "supported", "all fine", {"x": 1.0})

    def bad(ctx):
        raise RuntimeError("boom in the middle")

    monkeypatch.setattr(reproduce, "all_sections", lambda: [good, bad])
    args = argparse.Namespace(models=[], out=str(tmp_path / "r"), quick=True, seed=0, sections=None)
    code = reproduce.cmd_reproduce(args)
    assert code == 1
    doc = json.loads((tmp_path / "r" / "results.json").read_text())
    verdicts = {s["id"]: s["verdict"] for s in doc["sections"]}
    assert verdicts == {"good": "supported", "bad": "failed"}
    assert "boom in the middle" in doc["sections"][1]["summary"]
    html = (tmp_path / "r" / "report.html").read_text()
    assert "boom in the middle" in html and "Good section" in html
    assert "failed" in capsys.readouterr().out


def test_models_from_the_cache_and_missing_ones(tmp_path, monkeypatch, capsys):
    """--models adds a cached hub id to the real-model section; absent ones are named."""
    from hf_tiny import build
    root = tmp_path / "hub"
    snap = root / "models--tiny-org--tiny-bert" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    build("bert", snap, seed=1, vocab_size=30522)
    import shutil
    from powerlens.models.load import resolve
    for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(resolve("minilm"), f), snap / f)            # MiniLM's tokenizer
    (root / "models--tiny-org--tiny-bert" / "refs").mkdir()
    (root / "models--tiny-org--tiny-bert" / "refs" / "main").write_text("abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    from powerlens.reproduce import real_models
    monkeypatch.setattr(real_models, "DEFAULT_MODELS", [])      # keep the test small: the cached model only
    args = argparse.Namespace(models=["tiny-org/tiny-bert", "nobody/absent"], out=str(tmp_path / "r"), quick=True,
                              seed=0, sections=["layer_varying"])
    assert reproduce.cmd_reproduce(args) == 0
    doc = json.loads((tmp_path / "r" / "results.json").read_text())
    sec = doc["sections"][0]
    assert sec["numbers"]["models"] == ["tiny-org/tiny-bert"]
    assert "nobody/absent" in sec["numbers"]["not_found"] and "gpt2" in sec["numbers"]["not_found"]
    assert "nobody/absent" in sec["summary"]
    rows = sec["numbers"]["per_model"]["tiny-org/tiny-bert"]["paper"]["shifted"]["steps"]
    assert len(rows) == 3                                          # 2 layers + the initial state
