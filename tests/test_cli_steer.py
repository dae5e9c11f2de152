"""`powerlens steer` on an explicit system: the numbers it writes, and its bad-input errors."""
from __future__ import annotations

import json

import numpy as np
import pytest

from powerlens.cli import main
from powerlens._src.dynamics.synthetic import synthetic_system


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    root = tmp_path_factory.mktemp("steer")
    rng = np.random.default_rng(5)
    d, H = 8, 2
    one = synthetic_system([1.5, 0.8, 0.3], kind="nonnormal", heads=H, d=d, seed=5, dtype=np.float64)
    np.savez(root / "sys.npz", W_q=rng.normal(size=(H, 4, d)), W_k=rng.normal(size=(H, 4, d)), W_v=one.W_v[0],
             W_o=one.W_o[0])
    np.save(root / "x0.npy", rng.normal(size=(2, 6, d)))
    np.save(root / "u.npy", rng.normal(size=d))
    np.save(root / "zero.npy", np.zeros(d))
    return root


def steer(system, tmp_path, capsys, *extra):
    out = tmp_path / "out"
    code = main(["steer", "--weights", str(system / "sys.npz"), "--init", str(system / "x0.npy"),
                 "--direction", str(system / "u.npy"), "--out", str(out), *extra])
    captured = capsys.readouterr()
    doc = json.loads((out / "steer.json").read_text()) if code == 0 else None
    return code, doc, captured.err


def test_target_alignment_is_exact(system, tmp_path, capsys):
    """The solved alpha puts the worst token exactly at |cos| = c after the (single) layer."""
    code, doc, err = steer(system, tmp_path, capsys, "--target-alignment", "0.95", "--w", "value", "--sign-free")
    assert code == 0, err
    assert doc["alignment"]["min_after"] == pytest.approx(0.95, abs=2e-5)
    assert doc["alignment"]["min_after"] >= 0.95 - 2e-5
    assert len(doc["alignment"]["before"]) == 12
    assert doc["delta_norm"] == pytest.approx(doc["rank1"]["delta_norm"], rel=1e-9)
    # alignment against alpha: below target well under alpha*, above it beyond
    curve = doc["alignment_vs_alpha"]
    a = np.array(curve["alpha"])
    mins = np.array(curve["min"])
    assert np.all(mins[a < 0.5 * doc["alpha"]] < 0.95) and np.all(mins[a > 1.01 * doc["alpha"]] >= 0.95 - 1e-6)
    for f in ("alignment_vs_alpha.png", "alignment_hist.png"):
        assert (tmp_path / "out" / f).stat().st_size > 5000


def test_large_alpha_prediction(system, tmp_path, capsys):
    """At large alpha the top eigenvalue of F' is alpha (z.u) + z^T F u / (z.u) + O(1/alpha)."""
    code, doc, err = steer(system, tmp_path, capsys, "--alpha", "1000")
    assert code == 0, err
    r = doc["rank1"]
    assert r["exact_top_eigenvalue_shifted"][1] == pytest.approx(0.0, abs=1e-6)
    rel = abs(r["exact_top_eigenvalue_shifted"][0] - r["predicted_top_eigenvalue"]) / abs(r["predicted_top_eigenvalue"])
    assert rel < 1e-4
    assert r["eigenvector_cos_u"] > 0.999


def test_optimize_beats_closed_form(system, tmp_path, capsys):
    code, doc, err = steer(system, tmp_path, capsys, "--optimize", "--target-alignment", "0.9", "--rank", "2")
    assert code == 0, err
    opt = doc["optimize"]
    assert opt["feasible"] and opt["alignment"] >= 0.9 - 1e-3
    assert opt["norm"] <= opt["closed_norm"] * (1 + 1e-6)
    assert doc["alignment"]["min_after"] >= 0.9 - 2e-3          # re-simulated independently of the optimiser


@pytest.mark.parametrize("extra, message", [
    (["--alpha", "-1"], "alpha"),
    (["--alpha", "0"], "alpha"),
    (["--target-alignment", "1.5"], "strictly between 0 and 1"),
    (["--target-alignment", "0"], "strictly between 0 and 1"),
])
def test_bad_numbers(system, tmp_path, capsys, extra, message):
    code, _, err = steer(system, tmp_path, capsys, *extra)
    assert code == 2 and message in err
    assert not (tmp_path / "out").exists()


def test_bad_directions(system, tmp_path, capsys):
    for spec, message in ((str(system / "zero.npy"), "zero vector"), ("token:king", "needs a model"),
                          ("nowhere.npy", "does not exist"), ("sideways", "unknown direction")):
        out = tmp_path / "o"
        code = main(["steer", "--weights", str(system / "sys.npz"), "--init", str(system / "x0.npy"),
                     "--direction", spec, "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2 and message in err, (spec, err)
        assert not out.exists()
    np.save(system / "short.npy", np.ones(3))
    code = main(["steer", "--weights", str(system / "sys.npz"), "--init", str(system / "x0.npy"),
                 "--direction", str(system / "short.npy"), "--out", str(tmp_path / "o")])
    assert code == 2 and "dimension 3" in capsys.readouterr().err
