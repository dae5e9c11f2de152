"""Steering defaults that work on every supported model.

w="auto" (the default of the library and of ``powerlens steer --w``) is "inverse" where the
steered layer's stacked value matrix V_cat has full column rank and "value" otherwise: every
grouped-query model (SmolLM2, Gemma 3) has rank V_cat <= (KV heads) d_head < d, so "inverse"
(z = V_cat^T w = u) is impossible there and stays a clear refusal when asked for explicitly.
``--optimize`` reports the learned change by its norm and rank, not by an alpha.
"""
import dataclasses
import json

import numpy as np
import pytest

from powerlens.cli import main
from powerlens._src.dynamics.params import make_layers, value_matrix
from powerlens._src.steering import layer_w_choice, minimal_alpha, optimize_steering, rank1

D, E = 8, 4


def _system(kv_heads: int, seed: int = 0):
    """One softmax layer of width 8 with 4 query heads of size 4 (H e = 16 >= d) and
    ``kv_heads`` key/value heads: rank V_cat = min(kv_heads e, d) (4 < 8 for one KV head)."""
    rng = np.random.default_rng(seed)
    H = 4
    return make_layers(rng.normal(size=(1, kv_heads, E, D)) / np.sqrt(D),
                       rng.normal(size=(1, D, H * E)) / np.sqrt(H * E),
                       W_q=rng.normal(size=(1, H, E, D)), W_k=rng.normal(size=(1, kv_heads, E, D)))


@pytest.fixture(scope="module")
def full_rank():
    return _system(kv_heads=2)


@pytest.fixture(scope="module")
def grouped():
    return _system(kv_heads=1)


def _u(seed=3):
    u = np.random.default_rng(seed).normal(size=D)
    return u / np.linalg.norm(u)


def test_auto_is_inverse_on_a_full_rank_value_matrix(full_rank):
    choice = layer_w_choice(full_rank)
    assert (choice.requested, choice.kind, choice.rank, choice.d, choice.layer) == ("auto", "inverse", D, D, 0)
    assert choice.to_json() == {"requested": "auto", "used": "inverse", "value_rank": D, "d": D, "layer": 0}
    assert "full column rank 8" in choice.describe()
    r = rank1(full_rank, _u(), alpha=2.0, spectrum=False)            # default w
    assert r.w_kind == "inverse" and r.to_json()["w"] == "inverse"
    np.testing.assert_allclose(r.z, _u(), atol=1e-10)                 # z = V_cat^T w = u exactly


def test_auto_is_value_on_a_grouped_query_layer(grouped):
    V = np.asarray(value_matrix(grouped.layer(0)), np.float64)        # (16, 8), one KV head repeated 4 times
    assert V.shape == (16, D) and np.linalg.matrix_rank(V) == E
    choice = layer_w_choice(grouped)
    assert (choice.kind, choice.rank) == ("value", E)
    assert choice.describe() == "w=value (auto: layer 0's V_cat has rank 4 < d=8)"
    u = _u()
    r = rank1(grouped, u, alpha=2.0, spectrum=False)
    assert r.w_kind == "value" and r.to_json()["w"] == "value"
    np.testing.assert_allclose(r.w, V @ u / np.linalg.norm(V @ u), atol=1e-12)
    # the defaults of minimal_alpha and optimize_steering take the same w
    x0 = np.random.default_rng(4).normal(size=(2, 5, D))
    m = minimal_alpha(grouped, u, x0, target=0.9, signed=False)
    np.testing.assert_allclose(m.alignment.w, r.w, atol=1e-12)
    assert m.alignment.alpha > 0 and m.principal.alpha > 0
    res = optimize_steering(grouped, x0, u, target=0.9, reduce="min", steps=5, signed=False)
    assert res.w == "value" and res.to_json()["w"] == "value"
    np.testing.assert_allclose(res.closed_w[0], r.w, atol=1e-5)


def test_explicit_inverse_is_still_refused_on_a_grouped_query_layer(grouped):
    u = _u()
    for call in (lambda: layer_w_choice(grouped, "inverse"), lambda: rank1(grouped, u, alpha=1.0, w="inverse"),
                 lambda: optimize_steering(grouped, np.ones((3, D)), u, w="inverse", steps=2)):
        with pytest.raises(ValueError, match="w='inverse' needs V_cat\\^T V_cat invertible, but layer 0's value "
                                             "matrix is rank-deficient"):
            call()
    with pytest.raises(ValueError, match="unknown w 'pinv'"):
        layer_w_choice(grouped, "pinv")


def test_learned_change_reports_its_rank(full_rank):
    x0 = np.random.default_rng(6).normal(size=(2, 5, D))
    res = optimize_steering(full_rank, x0, _u(), target=0.9, reduce="min", rank=2, steps=60, signed=False)
    assert res.feasible[0]
    delta = res.delta_O[0]
    assert res.delta_rank(0) == np.linalg.matrix_rank(delta) == 2
    assert res.to_json(0)["delta_rank"] == 2 and res.to_json(0)["w"] == "inverse"
    # parallel columns of Q: P Q^T has rank 1, whatever its two factors
    Q = res.factor_Q.copy()
    Q[0, :, 1] = 3.0 * Q[0, :, 0]
    assert dataclasses.replace(res, factor_Q=Q).delta_rank(0) == 1
    nan = dataclasses.replace(res, factor_P=np.full_like(res.factor_P, np.nan))
    assert nan.delta_rank(0) == 0


# ------------------------------------------------------------------ the CLI on an explicit system

@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A weights file with H d_head = 6 < d = 8 (so V_cat is rank-deficient), and initial tokens."""
    root = tmp_path_factory.mktemp("defaults")
    rng = np.random.default_rng(2)
    H, e = 2, 3
    np.savez(root / "sys.npz", W_q=rng.normal(size=(H, e, D)), W_k=rng.normal(size=(H, e, D)),
             W_v=rng.normal(size=(H, e, D)) / np.sqrt(D), W_o=rng.normal(size=(D, H * e)) / np.sqrt(H * e))
    np.save(root / "x0.npy", rng.normal(size=(2, 5, D)))
    np.save(root / "u.npy", rng.normal(size=D))
    return root


def _steer_weights(weights, out, *extra):
    return main(["steer", "--weights", str(weights / "sys.npz"), "--init", str(weights / "x0.npy"),
                 "--direction", str(weights / "u.npy"), "--out", str(out), *extra])


def test_cli_optimize_reports_norm_and_rank_not_alpha(weights, tmp_path, capsys):
    code = _steer_weights(weights, tmp_path / "o", "--optimize", "--target-alignment", "0.9", "--rank", "2")
    out = capsys.readouterr().out
    assert code == 0
    doc = json.loads((tmp_path / "o" / "steer.json").read_text())
    assert doc["w"] == "value" and doc["w_choice"]["value_rank"] == 6
    assert "alpha" not in doc and "rank1" not in doc
    assert doc["delta_rank"] == doc["optimize"]["delta_rank"] == 2
    assert doc["delta_norm"] == pytest.approx(doc["optimize"]["norm"], rel=1e-5)
    assert doc["closed_form_at_equal_alignment"]["alpha"] == pytest.approx(doc["optimize"]["closed_alpha"], rel=1e-6)
    line = next(s for s in out.splitlines() if s.strip().startswith("gradient"))
    assert "alpha" not in line and f"||dO||_F={doc['delta_norm']:.4g} (rank 2)" in line
    assert "w=value (auto: layer 0's V_cat has rank 6 < d=8)" in out


def test_cli_optimize_without_a_feasible_change_is_an_error(weights, tmp_path, capsys, monkeypatch):
    """An optimiser run that found no feasible change (its factors are NaN) is refused, not written."""
    import powerlens._src.steering as steering
    real = steering.optimize_steering

    def infeasible(*args, **kwargs):
        res = real(*args, **kwargs)
        return dataclasses.replace(res, feasible=np.zeros_like(res.feasible),
                                   factor_P=np.full_like(res.factor_P, np.nan))

    monkeypatch.setattr(steering, "optimize_steering", infeasible)
    code = _steer_weights(weights, tmp_path / "o", "--optimize", "--target-alignment", "0.9", "--quiet")
    err = capsys.readouterr().err
    assert code == 2 and "--optimize found no change of rank <= 1 reaching alignment 0.9" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_cli_explicit_inverse_refused_before_writing(weights, tmp_path, capsys):
    code = _steer_weights(weights, tmp_path / "o", "--w", "inverse")
    err = capsys.readouterr().err
    assert code == 2 and "w='inverse' needs H*d_head >= d, but layer 0 has H*d_head=6 < d=8" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


# ------------------------------------------------------------------ real grouped-query models, default options

PROMPT = ["--direction", "token:London", "--text", "The capital of France is"]


def _steer_model(name, out, *extra):
    from powerlens._src.models import CheckpointError, resolve
    try:
        resolve(name)
    except CheckpointError as exc:
        pytest.skip(f"{name} is not installed here: {exc}")
    return main(["steer", name, *PROMPT, "--out", str(out), *extra])


@pytest.mark.parametrize("name, extra, rank, d, layer", [
    ("smollm2", (), 192, 576, 29),
    ("smollm2", ("--optimize",), 192, 576, 29),
    ("gemma3", (), 256, 640, 17),
])
def test_default_steer_runs_on_grouped_query_models(name, extra, rank, d, layer, tmp_path, capsys):
    code = _steer_model(name, tmp_path / "o", *extra)
    cap = capsys.readouterr()
    assert code == 0, cap.err
    doc = json.loads((tmp_path / "o" / "steer.json").read_text())
    assert doc["w"] == "value"
    assert doc["w_choice"] == {"requested": "auto", "used": "value", "value_rank": rank, "d": d, "layer": layer}
    assert f"w=value (auto: layer {layer}'s V_cat has rank {rank} < d={d})" in cap.out
    assert doc["alignment"]["min_after"] >= 0.99 - 2e-3              # the default target, re-simulated
    if extra:
        assert "alpha" not in doc and doc["delta_rank"] == 1
    else:
        assert doc["rank1"]["w"] == "value" and doc["alpha"] > 0


def test_explicit_inverse_refused_on_smollm2(tmp_path, capsys):
    code = _steer_model("smollm2", tmp_path / "o", "--w", "inverse")
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("powerlens steer: error: w='inverse' needs V_cat^T V_cat invertible, but layer 29's "
                          "value matrix is rank-deficient") and "use w='value'" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()
