"""The command line: simulate/spectrum on synthetic systems and weights files, with numbers."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from powerlens.cli import build_parser, main
from powerlens._src.models.npz import load_weights_npz, save_weights_npz
from powerlens._src.dynamics.synthetic import synthetic_system


def run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def read_metrics(path):
    with open(os.path.join(path, "metrics.json")) as fh:
        return json.load(fh)


@pytest.fixture(scope="module")
def uniform_run(tmp_path_factory):
    """Symmetric F with eigenvalues (3, 1, 0.5, 0, 0, 0), uniform attention, 40 steps."""
    out = tmp_path_factory.mktemp("sim") / "uniform"
    code = main(["simulate", "--spectrum", "3,1,0.5", "--dim", "6", "--kind", "symmetric", "--attention", "uniform",
                 "--tokens", "10", "--steps", "40", "--x64", "--quiet", "--save-states", "--out", str(out)])
    assert code == 0
    return out


def test_simulate_writes_documented_files(uniform_run):
    files = set(os.listdir(uniform_run))
    assert {"metrics.json", "metrics.csv", "states.npy", "eigenvalues.png", "alignment.png", "consensus.png",
            "trajectories.png"} <= files
    from powerlens._src.io import MARKER
    assert MARKER in files                                   # marks the folder as powerlens's own
    assert not any(f.startswith(".") for f in files - {MARKER})   # no temporary file left behind
    m = read_metrics(uniform_run)
    assert m["settings"]["versions"]["jax"]
    assert m["settings"]["attention"] == "uniform"
    assert len(m["steps"]) == 41 and [s["t"] for s in m["steps"]] == list(range(41))
    assert m["steps"][0]["rho"] is None                 # undefined before the first step
    assert all(s["rotation"] is None for s in m["steps"])  # real principal eigenvalue: no plane
    assert np.load(uniform_run / "states.npy").shape == (41, 10, 6)
    csv_lines = (uniform_run / "metrics.csv").read_text().strip().splitlines()
    assert len(csv_lines) == 42 and csv_lines[0].startswith("t,")


def test_simulate_numbers_match_theory(uniform_run):
    """Uniform attention: consensus rate 1/|1+lambda1| = 1/4; tokens end on v1 (gamma -> 1)."""
    m = read_metrics(uniform_run)
    layer = m["layers"][0]
    assert layer["eigenvalues_shifted"][0] == pytest.approx([3.0, 0.0], abs=1e-9)
    assert layer["ratio"] == pytest.approx(2.0 / 4.0, rel=1e-9)        # |1+1| / |1+3|
    assert layer["orderings_differ"] is False and layer["complex"] is False
    mu = np.array([s["consensus"] for s in m["steps"]])
    rates = mu[11:16] / mu[10:15]
    np.testing.assert_allclose(rates, 0.25, rtol=2e-3)
    assert m["steps"][-1]["gamma"] == pytest.approx(1.0, abs=1e-9)


def test_simulate_complex_pair_rotation(tmp_path, capsys):
    """A dominant pair 1 +- 1.5j rotates the tokens by arg(1 + lambda1) = atan2(1.5, 2) per step."""
    out = tmp_path / "rot"
    code, _, err = run(["simulate", "--spectrum", "1+1.5j,0.2", "--dim", "5", "--attention", "uniform", "--steps", "60",
                        "--tokens", "8", "--x64", "--quiet", "--out", str(out)], capsys)
    assert code == 0, err
    m = read_metrics(out)
    assert m["layers"][0]["complex"] is True and m["layers"][0]["dim"] == 2
    assert m["layers"][0]["rotation_per_step"] == pytest.approx(np.arctan2(1.5, 2.0), rel=1e-9)
    rot = np.array([s["rotation"] for s in m["steps"][-20:]])
    np.testing.assert_allclose(rot, np.arctan2(1.5, 2.0), atol=1e-6)


def test_weights_file_round_trip(tmp_path, capsys):
    """A two-layer npz: each layer once; final states equal an independent NumPy computation."""
    rng = np.random.default_rng(3)
    d, H, e, n = 6, 2, 3, 5
    arrays = {"W_q": rng.normal(size=(2, H, e, d)), "W_k": rng.normal(size=(2, H, e, d)),
              "W_v": rng.normal(size=(2, H, e, d)) / 3, "W_o": rng.normal(size=(2, d, H * e)) / 3,
              "b_q": rng.normal(size=(2, H, e)), "scale": np.array([0.5, 0.7])}
    np.savez(tmp_path / "sys.npz", **arrays)
    x0 = rng.normal(size=(n, d))
    np.save(tmp_path / "x0.npy", x0)
    out = tmp_path / "run"
    code, _, err = run(["simulate", "--weights", str(tmp_path / "sys.npz"), "--init", str(tmp_path / "x0.npy"),
                        "--save-states", "--x64", "--quiet", "--out", str(out)], capsys)
    assert code == 0, err
    m = read_metrics(out)
    assert len(m["steps"]) == 3 and len(m["layers"]) == 2
    states = np.load(out / "states.npy")
    X = x0.copy()
    for l in range(2):
        q = np.einsum("hed,nd->hne", arrays["W_q"][l], X) + arrays["b_q"][l][:, None]
        k = np.einsum("hed,nd->hne", arrays["W_k"][l], X)
        s = arrays["scale"][l] * np.einsum("hie,hje->hij", q, k)
        A = np.exp(s - s.max(-1, keepdims=True))
        A /= A.sum(-1, keepdims=True)
        heads = np.einsum("hij,hed,jd->ihe", A, arrays["W_v"][l], X).reshape(n, H * e)
        Y = X + heads @ arrays["W_o"][l].T
        X = Y / np.linalg.norm(Y, axis=1, keepdims=True)
        np.testing.assert_allclose(states[l + 1], X, atol=1e-10)


def test_weights_file_single_layer_shared(tmp_path, capsys):
    """A file without a layer axis is one layer; --steps T iterates it T times."""
    one = synthetic_system([2.0, 0.5], kind="symmetric", heads=2, d=4, seed=0, dtype=np.float64)
    np.savez(tmp_path / "one.npz", W_v=one.W_v[0], W_o=one.W_o[0])
    out = tmp_path / "o"
    code, _, err = run(["simulate", "--weights", str(tmp_path / "one.npz"), "--attention", "identity", "--steps", "7",
                        "--tokens", "3", "--quiet", "--out", str(out)], capsys)
    assert code == 0, err
    m = read_metrics(out)
    assert len(m["steps"]) == 8
    assert m["layers"][0]["eigenvalues_shifted"][0] == pytest.approx([2.0, 0.0], abs=1e-5)


def test_spectrum_weights(tmp_path, capsys):
    vs = [synthetic_system(eigs, kind="symmetric", heads=1, d=4, seed=s, dtype=np.float64)
          for s, eigs in enumerate([[-3.0, 1.5], [2.0, 0.1]])]
    np.savez(tmp_path / "s.npz", W_v=np.concatenate([v.W_v for v in vs]), W_o=np.concatenate([v.W_o for v in vs]))
    out = tmp_path / "spec"
    code, text, err = run(["spectrum", "--weights", str(tmp_path / "s.npz"), "--out", str(out)], capsys)
    assert code == 0, err
    doc = json.loads((out / "spectrum.json").read_text())
    assert [l["orderings_differ"] for l in doc["layers"]] == [True, False]
    assert doc["layers"][0]["eigenvalues_plain"][0] == pytest.approx([-3.0, 0.0], abs=1e-5)
    assert doc["layers"][0]["eigenvalues_shifted"][0] == pytest.approx([1.5, 0.0], abs=1e-5)
    assert (out / "eigenvalues.png").stat().st_size > 5000


@pytest.mark.parametrize("bad, message", [
    ({"W_o": None}, "'W_o' is missing"),
    ({"W_q": None}, "'W_q' is missing"),
    ({"W_o": np.zeros((6, 5))}, "'W_o' has shape (6, 5)"),
    ({"b_q": np.zeros((3, 3))}, "'b_q' has shape"),
    ({"W_v": np.full((2, 3, 6), np.nan)}, "'W_v' contains non-finite"),
    ({"bogus": np.zeros(2)}, "unknown key"),
])
def test_bad_weights_file(tmp_path, capsys, bad, message):
    rng = np.random.default_rng(0)
    arrays = {"W_q": rng.normal(size=(2, 3, 6)), "W_k": rng.normal(size=(2, 3, 6)),
              "W_v": rng.normal(size=(2, 3, 6)), "W_o": rng.normal(size=(6, 6))}
    for k, v in bad.items():
        if v is None:
            arrays.pop(k)
        else:
            arrays[k] = v
    np.savez(tmp_path / "bad.npz", **arrays)
    out = tmp_path / "never"
    code, _, err = run(["simulate", "--weights", str(tmp_path / "bad.npz"), "--out", str(out), "--quiet"], capsys)
    assert code == 2
    assert message in err and "bad.npz" in err
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "steps must be a positive integer"),
    (["--tokens", "0"], "--tokens must be positive"),
    (["--spectrum", "1,zz"], "cannot parse eigenvalue 'zz'"),
    (["--spectrum", "1+2j", "--kind", "symmetric"], "needs a real spectrum"),
])
def test_bad_options(tmp_path, capsys, argv, message):
    base = {"--spectrum": "2,1", "--steps": "3"}
    args = ["simulate", "--quiet", "--out", str(tmp_path / "x")]
    given = dict(zip(argv[::2], argv[1::2]))
    for k, v in {**base, **given}.items():
        args += [k, v]
    code, _, err = run(args, capsys)
    assert code == 2 and message in err
    assert not (tmp_path / "x").exists()


def test_bad_init_file(tmp_path, capsys):
    np.save(tmp_path / "x0.npy", np.zeros((4, 3)))
    code, _, err = run(["simulate", "--spectrum", "2,1", "--init", str(tmp_path / "x0.npy"), "--steps", "2", "--quiet",
                        "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "expected shape (n, 2)" in err
    np.save(tmp_path / "x0.npy", np.zeros((4, 2)))
    code, _, err = run(["simulate", "--spectrum", "2,1", "--init", str(tmp_path / "x0.npy"), "--steps", "2", "--quiet",
                        "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "zero-norm token" in err


def test_failed_run_keeps_existing_output(tmp_path, capsys):
    out = tmp_path / "keep"
    out.mkdir()
    (out / "metrics.json").write_text("old")
    code, _, _ = run(["simulate", "--spectrum", "2,1", "--steps", "0", "--out", str(out)], capsys)
    assert code == 2
    assert (out / "metrics.json").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["keep"]       # no staging folder left behind


def test_multilayer_steps_needs_shared_layer(tmp_path, capsys):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "two.npz", W_v=rng.normal(size=(2, 1, 2, 2)), W_o=rng.normal(size=(2, 2, 2)))
    code, _, err = run(["simulate", "--weights", str(tmp_path / "two.npz"), "--attention", "uniform", "--steps", "3",
                        "--quiet", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "--shared-layer" in err


def test_help_documents_every_option():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        for action in p._actions:
            if action.option_strings and action.help != "==SUPPRESS==":
                assert action.help, f"{name} {action.option_strings} has no help"


def test_npz_save_load_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "a.npz", W_q=rng.normal(size=(2, 3, 6)), W_k=rng.normal(size=(2, 3, 6)),
             W_v=rng.normal(size=(2, 3, 6)), W_o=rng.normal(size=(6, 6)), causal=True, window=2)
    layers = load_weights_npz(str(tmp_path / "a.npz"))
    save_weights_npz(str(tmp_path / "b.npz"), layers)
    again = load_weights_npz(str(tmp_path / "b.npz"))
    assert again.config.causal and int(again.window[0]) == 2
    np.testing.assert_array_equal(np.asarray(again.W_o), np.asarray(layers.W_o))


_CACHE_PROBE = """
import os, sys
from powerlens.cli import _compilation_cache
folder = _compilation_cache()
print(folder)
if folder:
    import jax, jax.numpy as jnp
    jax.block_until_ready(jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))))
    print(len([f for f in os.listdir(folder) if f.endswith("-cache")]))
"""


@pytest.mark.parametrize("setting", ["default", "off", "user", "unwritable"])
def test_compilation_cache_folder(tmp_path, setting):
    """The CLI keeps compiled programs under cache_dir()/xla (the entries are written there),
    not at all with POWERLENS_XLA_CACHE=off or where the folder cannot be made, and in the
    user's own JAX cache folder when one is set."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(POWERLENS_CACHE=str(tmp_path / "pl"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    if setting == "off":
        env["POWERLENS_XLA_CACHE"] = "off"
    if setting == "user":
        env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "mine")
    if setting == "unwritable":                                   # a file where the folder would go
        (tmp_path / "file").write_text("")
        env["POWERLENS_CACHE"] = str(tmp_path / "file" / "pl")
    out = subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=env, capture_output=True, text=True,
                         timeout=120).stdout.split()
    expected = {"default": str(tmp_path / "pl" / "xla"), "off": "None", "user": str(tmp_path / "mine"),
                "unwritable": "None"}[setting]
    assert out[0] == expected
    if setting not in ("off", "unwritable"):
        assert int(out[1]) >= 1                          # the programs it compiled
    else:
        assert not (tmp_path / "pl" / "xla").exists()
