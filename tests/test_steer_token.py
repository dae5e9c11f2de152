"""objective="token": the least-norm edit of a linear case, the requested rank, and that the
reported probabilities are the model's own (pl.steered_model, pl.run_states, pl.logits)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import powerlens as pl
from powerlens._src.dynamics.params import LayerConfig, make_layers
from powerlens._src.models.base import Model, ModelInfo

D, H, E, VOCAB = 6, 2, 3, 2


def tiny_decoder(seed: int = 0, vocab: int = VOCAB) -> Model:
    """One pre-norm causal block (l2 norm before attention, an FFN of zeros), no final norm, a
    tied head of ``vocab`` rows."""
    rng = np.random.default_rng(seed)
    cfg = LayerConfig(d_model=D, n_heads=H, n_kv_heads=H, d_head=E, norm="l2", norm_placement="pre", causal=True,
                      ffn_activation="relu")
    layers = make_layers(W_v=rng.normal(size=(1, H, E, D)), W_o=rng.normal(size=(1, D, H * E)),
                         W_q=rng.normal(size=(1, H, E, D)), W_k=rng.normal(size=(1, H, E, D)),
                         W_in=np.zeros((1, 4, D)), W_out=np.zeros((1, D, 4)), config=cfg)
    layers = layers.replace(**{k: getattr(layers, k).astype(np.float32) for k in ("W_q", "W_k", "W_v", "W_o",
                                                                                    "W_in", "W_out")})
    word = rng.normal(size=(vocab, D)).astype(np.float32)
    return Model(layers=layers, embeddings={"word": word},
                 info=ModelInfo(family="synthetic", source="", decoder=True, pad_token_id=0))


def test_least_norm_edit_of_a_linear_margin():
    """One prompt of one token x, one block, FFN zero, no final norm, two tokens (t and o).

    With one token, softmax attention is the identity, so the head mix m = V_cat (x/||x||)
    (H e,) does not depend on W_o, and the final state is h = x + (W_o + dO) m. The logits
    are z = W_U h, so p(t) = sigmoid(z_t - z_o) and p(t) >= c is the linear constraint

        a^T dO m >= delta,   a = w_t - w_o,   delta = logit(c) - a^T (x + W_o m)  (> 0 here).

    The least-norm dO with a^T dO m = <a m^T, dO>_F >= delta is the projection onto that
    half-space: dO* = delta a m^T / (||a||^2 ||m||^2), ||dO*||_F = delta / (||a|| ||m||).
    The control (the same token, KL bound 50 nats) never binds. The optimiser must reach
    ||dO*|| within 1 % and the direction of dO* (cosine > 0.99)."""
    model = tiny_decoder(1)
    W = np.asarray(model.embeddings["word"], np.float64)
    x = W[1]
    a = W[0] - W[1]
    Vc = np.asarray(pl.value_matrix(model.layers.layer(0)), np.float64)
    m = Vc @ (x / np.linalg.norm(x))
    h0 = x + np.asarray(model.layers.W_o[0], np.float64) @ m
    c = 0.9
    delta = np.log(c / (1 - c)) - a @ h0
    assert delta > 0.5                                    # the constraint binds
    best = delta * np.outer(a, m) / (a @ a * (m @ m))
    res = pl.optimize_steering(model, x[None, None], 0, objective="token", target_prob=c, max_kl=50.0,
                               controls=[[1]], rank=1, steps=400, lr=1e-2, w="value")
    assert res.feasible[0]
    assert res.norm[0] == pytest.approx(np.linalg.norm(best), rel=1e-2)
    got = res.delta_O[0]
    assert np.sum(got * best) / (np.linalg.norm(got) * np.linalg.norm(best)) > 0.99
    assert res.target_prob[0, 0] >= c - 1e-3


@settings(max_examples=4, deadline=None)
@given(rank=st.integers(1, 3), seed=st.integers(0, 50))
def test_learned_edit_has_the_requested_rank(rank, seed):
    """Every feasible learned dO = n0 P Q^T has exactly the requested rank (its factors' SVD,
    and numpy's rank of the dense matrix)."""
    from hypothesis import assume
    model = tiny_decoder(seed % 3)
    ids = np.random.default_rng(seed).integers(0, VOCAB, size=(1, 3))
    x0, valid = pl.embed_ids(model, ids)
    res = pl.optimize_steering(model, x0, 1, objective="token", valid=valid, target_prob=0.6, max_kl=50.0,
                               controls=[[1, 0]], rank=rank, steps=100, lr=1e-2)
    assume(res.feasible[0])
    assert res.delta_O.shape == (1, D, H * E)
    assert res.delta_rank(0) == rank
    assert np.linalg.matrix_rank(res.delta_O[0], tol=1e-6 * np.linalg.norm(res.delta_O[0])) == rank


def _prob_of(model, x0, valid, target):
    """p(target | prompt) at each prompt's last valid token: run_states (rule full), logits."""
    h = np.asarray(pl.run_states(model, x0, valid, rule="full")[-1])
    last = valid.shape[1] - 1 - np.argmax(np.asarray(valid)[:, ::-1], axis=1)
    z = np.asarray(pl.logits(model, h[np.arange(len(last)), last]), np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True))[:, target]


def test_reported_probability_is_the_models_own():
    """The saved edit, applied with pl.steered_model and run through pl.run_states(rule='full')
    and pl.logits, gives the reported target probability (1e-3); so does the activation vector,
    added as the FFN output bias of the edited block."""
    from powerlens._src.steering.compare import activation_model
    model = tiny_decoder(2, vocab=3)
    ids = np.array([[1, 0, 2], [2, 1, 0]])
    valid = np.array([[True, True, True], [True, True, False]])
    x0, valid = pl.embed_ids(model, ids, valid)
    res = pl.optimize_steering(model, x0, [1, 2], objective="token", valid=valid, target_prob=0.6, max_kl=5.0,
                               controls=[[1, 2, 0]], rank=2, steps=200, lr=1e-2)
    assert res.feasible.all()
    for k, t in enumerate((1, 2)):
        p = _prob_of(pl.steered_model(model, res.delta_O[k].astype(np.float32)), x0, valid, t)
        np.testing.assert_allclose(p, res.target_prob[k], atol=1e-3)
        assert np.all(p >= 0.6 - 1e-3)
    act = pl.optimize_steering(model, x0, 1, objective="token", valid=valid, param="activation", target_prob=0.6,
                               max_kl=5.0, controls=[[1, 2, 0]], steps=200, lr=1e-2)
    assert act.feasible[0] and act.norm[0] == pytest.approx(np.linalg.norm(act.vector[0]), rel=1e-5)
    p = _prob_of(activation_model(model, act.vector[0]), x0, valid, 1)
    np.testing.assert_allclose(p, act.target_prob[0], atol=1e-3)


def test_token_objective_bad_inputs():
    model = tiny_decoder(0)
    x0 = np.ones((1, 2, D), np.float32)
    with pytest.raises(ValueError, match="needs a loaded causal decoder"):
        pl.optimize_steering(model.layers, x0, 0, objective="token")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        pl.optimize_steering(model, x0, 9, objective="token", controls=[[1]])
    with pytest.raises(ValueError, match="target_prob must be"):
        pl.optimize_steering(model, x0, 0, objective="token", target_prob=1.5, controls=[[1]])
    with pytest.raises(ValueError, match="unknown objective"):
        pl.optimize_steering(model, x0, 0, objective="logits")
    with pytest.raises(ValueError, match="unknown param"):
        pl.optimize_steering(model, x0, 0, objective="token", param="full", controls=[[1]])


@pytest.mark.parametrize("extra, message", [
    (["--target-prob", "1.5"], "--target-prob must lie strictly between 0 and 1"),
    (["--max-kl", "0"], "--max-kl must be a finite number > 0"),
    (["--direction", "random"], "needs --direction token:WORD"),
])
def test_cli_token_objective_errors(tmp_path, capsys, extra, message):
    from powerlens.cli import main
    argv = ["steer", "smollm2", "--text", "Hi", "--direction", "token: London", "--objective", "token",
            "--out", str(tmp_path / "o")]
    if "--direction" in extra:
        argv[argv.index("--direction") + 1] = extra[1]
        extra = []
    code = main(argv + extra)
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_cli_token_only_options_need_the_token_objective(tmp_path, capsys):
    from powerlens.cli import main
    code = main(["steer", "smollm2", "--text", "Hi", "--direction", "token: London", "--layer", "3",
                 "--out", str(tmp_path / "o")])
    assert code == 2 and "--layer needs --objective token" in capsys.readouterr().err


def test_w_alpha_is_the_closed_form_ray_with_only_alpha_learned():
    """objective='token', param='w_alpha': the edit stays on the closed-form ray, dO = alpha u w^T
    with w the start's w (rank 1, the same direction of w_cf), and the learned alpha is the
    smallest one on that ray whose edit reaches target_prob at every prompt. That smallest alpha
    is found here independently: p(target) of pl.steered_model(model, alpha u w^T) through
    run_states(rule='full') and pl.logits on a fine grid of alpha, refined by bisection on the
    first crossing (the KL bound, 5 nats, does not bind)."""
    model = tiny_decoder(2, vocab=3)
    ids = np.array([[1, 0, 2], [2, 1, 0]])
    valid = np.array([[True, True, True], [True, True, False]])
    x0, valid = pl.embed_ids(model, ids, valid)
    res = pl.optimize_steering(model, x0, 1, objective="token", valid=valid, param="w_alpha", target_prob=0.6,
                               max_kl=5.0, controls=[[1, 2, 0]], steps=200, lr=1e-2)
    assert res.feasible[0] and res.delta_rank(0) == 1
    dO = res.delta_O[0]
    u = np.asarray(res.directions[0], np.float64)
    w = u @ dO                                        # dO = alpha u w^T with ||u|| = 1 -> alpha w
    np.testing.assert_allclose(dO, np.outer(u, w), atol=1e-6 * np.abs(dO).max())
    w_hat = w / np.linalg.norm(w)
    V = np.asarray(model.layers.W_v[0], np.float64).reshape(H * E, D)      # V_cat (H e, d)
    w_cf = np.linalg.pinv(V.T) @ u if res.w == "inverse" else V @ u        # rank1.resolve_w's two rules
    assert abs(w_hat @ w_cf) / np.linalg.norm(w_cf) == pytest.approx(1.0, abs=1e-5)
    min_p = lambda a: _prob_of(pl.steered_model(model, (a * np.outer(u, w_hat)).astype(np.float32)),
                               x0, valid, 1).min()
    grid = np.geomspace(1e-3, 1e3, 241)
    ok = np.array([min_p(a) >= 0.6 for a in grid])
    assert ok.any()
    first = int(np.argmax(ok))
    lo, hi = (grid[first - 1] if first else 0.0), grid[first]
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if min_p(mid) >= 0.6 else (mid, hi)
    assert res.norm[0] == pytest.approx(hi, rel=1e-2)
    assert res.norm[0] == pytest.approx(np.linalg.norm(dO), rel=1e-5)


def test_returned_edits_end_on_the_boundary_of_the_feasible_set():
    """The returned edit of each method is minimal along its own ray: with the KL bound slack
    (5 nats), the worst prompt's p(target), recomputed with pl.steered_model (or the activation
    model) through run_states(rule='full') and pl.logits, is at target_prob (to 1e-3), and 0.99
    times the same edit no longer reaches it at every prompt."""
    from powerlens._src.steering.compare import activation_model
    model = tiny_decoder(2, vocab=3)
    ids = np.array([[1, 0, 2], [2, 1, 0]])
    valid = np.array([[True, True, True], [True, True, False]])
    x0, valid = pl.embed_ids(model, ids, valid)
    kw = dict(objective="token", valid=valid, target_prob=0.6, max_kl=5.0, controls=[[1, 2, 0]], steps=150, lr=1e-2)
    for param in ("lowrank", "activation", "w_alpha"):
        res = pl.optimize_steering(model, x0, [1, 2], param=param, **kw)
        assert res.feasible.any(), param
        assert np.all(res.shrink[res.feasible] <= 1.0) and np.all(res.shrink[res.feasible] > 0.0)
        for k, t in enumerate((1, 2)):
            if not res.feasible[k]:
                continue
            if param == "activation":
                edited = lambda s: activation_model(model, s * res.vector[k])
            else:
                edited = lambda s: pl.steered_model(model, (s * res.delta_O[k]).astype(np.float32))
            p_min = _prob_of(edited(1.0), x0, valid, t).min()
            assert 0.6 - 1e-6 <= p_min <= 0.6 + 1e-3, (param, t, p_min)
            assert _prob_of(edited(0.99), x0, valid, t).min() < 0.6, (param, t)
