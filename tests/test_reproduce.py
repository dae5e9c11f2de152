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
from test_no_torch import without_torch

SECTIONS = ["bipartite"]


def _cmd(out):
    return [sys.executable, "-m", "powerlens.cli", "reproduce", "--quick", "--out", str(out), "--sections", *SECTIONS]


def _chunks(out):
    root = os.path.join(out, ".chunks")
    return [f for _, _, fs in os.walk(root) for f in fs if f.endswith(".json")]


@pytest.mark.slow
def test_resume_after_kill_gives_identical_results(tmp_path):
    """Also the no-torch check of the synthetic sections (test_no_torch.py runs the real-model
    ones): every process here runs with torch made unimportable."""
    env = without_torch(dict(os.environ, PYTHONUNBUFFERED="1"))
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
    for run in (resumed, clean):
        checks = {line for line in run.stderr.splitlines() if line.startswith("NO-TORCH-CHECK")}
        assert checks == {"NO-TORCH-CHECK: none"}, run.stderr[-3000:]


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
    _tiny_cached_bert(tmp_path, monkeypatch)      # keep the test small: the cached model only
    args = argparse.Namespace(models=["tiny-org/tiny-bert", "nobody/absent"], out=str(tmp_path / "r"), quick=True,
                              seed=0, sections=["layer_varying"], jobs=1)
    assert reproduce.cmd_reproduce(args) == 0
    doc = json.loads((tmp_path / "r" / "results.json").read_text())
    sec = doc["sections"][0]
    assert sec["numbers"]["models"] == ["tiny-org/tiny-bert"]
    assert "nobody/absent" in sec["numbers"]["not_found"] and "gpt2" in sec["numbers"]["not_found"]
    assert "nobody/absent" in sec["summary"]
    rows = sec["numbers"]["per_model"]["tiny-org/tiny-bert"]["paper"]["shifted"]["steps"]
    assert len(rows) == 3                                          # 2 layers + the initial state


def _tiny_cached_bert(tmp_path, monkeypatch):
    """A tiny BERT in a fake HF cache (with MiniLM's tokenizer), as the only real model."""
    import shutil
    from hf_tiny import build
    from powerlens.models.load import resolve
    from powerlens.reproduce import real_models
    root = tmp_path / "hub"
    snap = root / "models--tiny-org--tiny-bert" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    build("bert", snap, seed=1, vocab_size=30522)
    for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(resolve("minilm"), f), snap / f)
    (root / "models--tiny-org--tiny-bert" / "refs").mkdir()
    (root / "models--tiny-org--tiny-bert" / "refs" / "main").write_text("abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setattr(real_models, "DEFAULT_MODELS", [])


@pytest.mark.slow
def test_worker_processes_give_the_serial_results(tmp_path, monkeypatch, capsys):
    """--jobs 2 computes the real model's chunks in a worker process; results.json is the same
    bytes as with --jobs 1, and the worker's chunks count as computed, not resumed."""
    _tiny_cached_bert(tmp_path, monkeypatch)
    outs = {}
    for jobs in (1, 2):
        args = argparse.Namespace(models=["tiny-org/tiny-bert"], out=str(tmp_path / f"j{jobs}"), quick=True, seed=0,
                                  sections=["layer_varying"], jobs=jobs)
        assert reproduce.cmd_reproduce(args) == 0
        outs[jobs] = capsys.readouterr().out
    assert (tmp_path / "j1" / "results.json").read_bytes() == (tmp_path / "j2" / "results.json").read_bytes()
    assert "(0 chunks resumed, 2 computed)" in outs[1] and "(0 chunks resumed, 2 computed)" in outs[2]


def test_a_failed_worker_leaves_its_model_to_the_main_process(tmp_path, capsys):
    from concurrent.futures import Future
    from powerlens.reproduce import Context
    from powerlens.sweeps.store import ChunkFolder
    ctx = Context(out=str(tmp_path), store=ChunkFolder(str(tmp_path), {}), quick=True, seed=0, models=[])
    dead = Future()
    dead.set_exception(RuntimeError("worker killed"))
    ctx.pending["m"] = dead
    assert ctx.model_chunk("m", "k", lambda: {"x": 1.5}) == {"x": 1.5}
    assert "the worker process for m failed (RuntimeError: worker killed)" in capsys.readouterr().err
    assert ctx.store.computed == 1 and not ctx.pending


@pytest.mark.parametrize("jobs", [0, -1, 1.5, True, "2"])
def test_bad_jobs_is_a_clear_error(jobs):
    from powerlens.reproduce.workers import check_jobs
    with pytest.raises(ValueError, match="--jobs must be a positive integer"):
        check_jobs(jobs)


def test_main_process_xla_threads_and_the_workers_environment(monkeypatch):
    """reproduce asks for its own XLA on one thread (set before the backend starts; the user's
    XLA_FLAGS or POWERLENS_XLA_THREADS thread choice wins), and the workers start from the
    user's environment, not from that one thread: fewer workers than cores keep XLA's threads,
    workers that fill them get one."""
    from powerlens.reproduce import workers
    from powerlens.sweeps.distributed import SINGLE_THREAD_XLA, XLA_THREADS
    monkeypatch.setattr(workers, "_USER_ENV", [])
    monkeypatch.delenv(XLA_THREADS, raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true")
    assert workers.single_threaded_main(os.environ) and workers._USER_ENV == []            # the user's choice
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_hlo_as_text")
    monkeypatch.setenv(XLA_THREADS, "0")
    assert workers.single_threaded_main(os.environ) and workers._USER_ENV == []            # theirs again
    monkeypatch.delenv(XLA_THREADS)
    from jax._src import xla_bridge
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    assert workers.single_threaded_main(os.environ)
    assert os.environ["XLA_FLAGS"] == "--xla_dump_hlo_as_text " + SINGLE_THREAD_XLA
    assert os.environ[XLA_THREADS] == "1"
    monkeypatch.setattr(workers, "cores", lambda: 8)
    env = workers.worker_env(3)
    assert env["XLA_FLAGS"] == "--xla_dump_hlo_as_text" and XLA_THREADS not in env
    monkeypatch.setattr(workers, "cores", lambda: 2)
    env = workers.worker_env(3)
    assert env["XLA_FLAGS"] == "--xla_dump_hlo_as_text " + SINGLE_THREAD_XLA and env["OMP_NUM_THREADS"] == "1"
    assert env[XLA_THREADS] == "1"
    monkeypatch.setattr(workers, "_USER_ENV", [])
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_hlo_as_text")
    monkeypatch.delenv(XLA_THREADS)
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    assert not workers.single_threaded_main(os.environ)                  # too late: XLA keeps its threads