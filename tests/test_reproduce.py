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

from powerlens._src import reproduce
from powerlens._src.reproduce.section import SectionResult
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
    from powerlens._src.models.load import resolve
    from powerlens._src.reproduce import real_models
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
    from powerlens._src.reproduce import Context
    from powerlens._src.sweeps.store import ChunkFolder
    ctx = Context(out=str(tmp_path), store=ChunkFolder(str(tmp_path), {}), quick=True, seed=0, models=[])
    dead = Future()
    dead.set_exception(RuntimeError("worker killed"))
    ctx.pending["m"] = dead
    assert ctx.model_chunk("m", "k", lambda: {"x": 1.5}) == {"x": 1.5}
    assert "the worker process for m failed (RuntimeError: worker killed)" in capsys.readouterr().err
    assert ctx.store.computed == 1 and not ctx.pending


@pytest.mark.parametrize("jobs", [0, -1, 1.5, True, "2"])
def test_bad_jobs_is_a_clear_error(jobs):
    from powerlens._src.reproduce.workers import check_jobs
    with pytest.raises(ValueError, match="--jobs must be a positive integer"):
        check_jobs(jobs)


def test_main_process_xla_threads_and_the_workers_environment(monkeypatch):
    """reproduce asks for its own XLA on one thread (set before the backend starts; the user's
    XLA_FLAGS or POWERLENS_XLA_THREADS thread choice wins), and the workers start from the
    user's environment (the copy the command line keeps), not from that one thread: fewer
    workers than cores keep XLA's threads, workers that fill them get one."""
    from powerlens._src.runtime import threads
    from powerlens._src.runtime.threads import SINGLE_THREAD_XLA, XLA_THREADS
    monkeypatch.delenv(XLA_THREADS, raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true")
    assert threads.single_threaded_main(os.environ) and XLA_THREADS not in os.environ       # the user's choice
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_hlo_as_text")
    monkeypatch.setenv(XLA_THREADS, "0")
    assert threads.single_threaded_main(os.environ) and os.environ[XLA_THREADS] == "0"      # theirs again
    monkeypatch.delenv(XLA_THREADS)
    from jax._src import xla_bridge
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    user = dict(os.environ)
    assert threads.single_threaded_main(os.environ)
    assert os.environ["XLA_FLAGS"] == "--xla_dump_hlo_as_text " + SINGLE_THREAD_XLA
    assert os.environ[XLA_THREADS] == "1"
    env = threads.worker_env(3, cores=8, base=user)
    assert env["XLA_FLAGS"] == "--xla_dump_hlo_as_text" and XLA_THREADS not in env
    env = threads.worker_env(3, cores=2, base=user)
    assert env["XLA_FLAGS"] == "--xla_dump_hlo_as_text " + SINGLE_THREAD_XLA and env["OMP_NUM_THREADS"] == "1"
    assert env[XLA_THREADS] == "1"
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_hlo_as_text")
    monkeypatch.delenv(XLA_THREADS)
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    assert not threads.single_threaded_main(os.environ)                  # too late: XLA keeps its threads

def test_section_7_verdicts_from_given_numbers():
    """Section 7's two verdicts are computed from their numbers: the output claim holds on a
    model when the better optimised edit reaches 75 % of the targets (closed forms do not
    count), the paper claim from its four paper-rule checks; the section's badge combines them."""
    from powerlens._src.reproduce import steering_section as S
    assert S.reaches([0.4995, 0.7], 0.5005) and not S.reaches([0.498, 0.9], 0.1)
    assert not S.reaches([0.9, 0.9], 0.502) and not S.reaches([float("nan")], 0.0) and not S.reaches(None, None)
    shares = {"smollm2": {"gradient": 0.75, "activation_addition": 0.25, "closed_form_paper_alpha": 1.0},
              "gemma3": {"gradient": 0.5, "activation_addition": 0.625, "closed_form_token_alpha": 1.0}}
    verdict, checks = S.output_claim_verdict(shares)
    assert verdict == "partly supported" and list(checks.values()) == [True, False]
    assert S.output_claim_verdict({m: {"gradient": 0.875} for m in shares})[0] == "supported"
    assert S.output_claim_verdict({m: {"activation_addition": 0.7} for m in shares})[0] == "not supported"
    assert S.output_claim_verdict({}) == ("skipped", {})
    targets = [{"gradient": {"beta": b, "reached": ok, "min_target_prob": 0.5, "control_kl_mean": 0.1,
                             "delta_norm": 2 * b}} for b, ok in ((1.0, True), (3.0, True), (9.0, False))]
    targets.append({"gradient": {"found": False, "reached": False}})
    s = S.method_summary(targets, "gradient")
    assert (s["reached"], s["targets"], s["share"]) == (2, 4, 0.5)
    assert s["median_beta_reached"] == 2.0 and s["median_beta"] == 3.0 and s["median_delta_norm_reached"] == 4.0

    def row(cos, abs_min, feasible, g_norm, before, after):
        return {"principal_alpha": {"cos": cos}, "gradient": {"feasible": feasible, "norm": g_norm},
                "closed": {"norm": 10.0, "effects": {"paper_rule_alignment": {"rank1": {"abs_min": abs_min}},
                                                     "conditions": {"rank1": {"abs_alignment": after},
                                                                    "before": {"abs_alignment": before}}}}}
    assert S.paper_claim_verdict([row(0.99, 0.9, True, 1.0, 0.1, 0.5)])[0] == "supported"
    verdict, checks = S.paper_claim_verdict([row(0.99, 0.9, True, 1.0, 0.1, 0.5), row(0.9, 0.8, True, 11.0, 0.1, 0.5)])
    assert verdict == "partly supported" and list(checks.values()) == [False, False, False, True]
    assert S.section_verdict("supported", "not supported") == "partly supported"
    assert S.section_verdict("supported", "supported") == "supported"
    assert S.section_verdict("supported", "skipped") == "supported"


def test_section_7_output_claim_on_a_tiny_decoder():
    """The output claim's chunk on a tiny random decoder (MiniLM's tokenizer for the text),
    2 targets, 2 Adam steps: every method is measured on the model's own forward pass, the
    closed form with the token α puts the worst prompt at p = 0.5 (the level it was chosen
    for), and a target counts as reached only with the control KL in bound too."""
    import jax.numpy as jnp
    import numpy as np
    from powerlens._src.dynamics.params import LayerConfig, make_layers
    from powerlens._src.models.base import Model, ModelInfo
    from powerlens._src.models.load import resolve
    from powerlens._src.reproduce import steering_section as S
    rng = np.random.default_rng(0)
    V, d, H, e, f, L = 30522, 8, 2, 4, 12, 1
    cfg = LayerConfig(d_model=d, n_heads=H, d_head=e, causal=True, norm="rmsnorm", norm_eps=1e-6,
                      norm_placement="pre", ffn_activation="silu_glu")
    r = lambda *s, sc=0.4: (sc * rng.standard_normal(s)).astype(np.float32)
    layers = make_layers(r(L, H, e, d), r(L, d, H * e), W_q=r(L, H, e, d), W_k=r(L, H, e, d), config=cfg,
                         norm_scale=1 + r(L, d, sc=0.1), ffn_norm_scale=1 + r(L, d, sc=0.1), W_in=r(L, f, d),
                         W_gate=r(L, f, d), W_out=r(L, d, f))
    word = r(V, d, sc=1.0)
    word[[2000, 3000]] *= 4
    model = Model(layers=layers, embeddings={"word": jnp.asarray(word)}, final_norm_scale=None, lm_head=None,
                  info=ModelInfo(family="llama", source="synthetic", decoder=True, name="tiny",
                                 tokenizer=resolve("minilm")))
    res = S.output_claim_numbers(model, ["the cat sat on", "a dog ran to"], [2000, 3000], steps=2, seed=0)
    assert [t["target_id"] for t in res["targets"]] == [2000, 3000]
    for t in res["targets"]:
        assert set(S.METHODS) <= set(t) and t["before"]["beta"] == 0.0
        for m in S.METHODS:
            got = t[m]
            if "beta" in got:
                assert got["reached"] == S.reaches(got["target_prob"], got["control_kl_mean"])
                assert len(got["target_prob"]) == 2 and got["min_target_prob"] == min(got["target_prob"])
    token_ray = res["targets"][1]["closed_form_token_alpha"]
    assert token_ray["ray_reaches_target_prob"] and token_ray["beta"] > 0
    assert token_ray["min_target_prob"] == pytest.approx(0.5, abs=1e-3)
    assert token_ray["control_kl_mean"] > 0.5 and not token_ray["reached"]
    summary = S.method_summary(res["targets"], "closed_form_token_alpha")
    assert summary["targets"] == 2 and summary["reached"] == 0
