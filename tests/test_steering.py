"""Steering on synthetic systems: closed form, minimal alpha, gradient steering, effects, errors.

Every number is checked against an independent derivation: the characteristic
polynomial of a rank-1 update, the secular-equation asymptotics, the one-step cosine
relation (checked by running the layer), a NumPy re-implementation of a tiny decoder.
"""
import numpy as np
import jax.numpy as jnp
import pytest

from powerlens._src.dynamics import synthetic as S
from powerlens._src.dynamics.layer import layer_step
from powerlens._src.dynamics.params import LayerConfig, make_layers, value_matrix
from powerlens._src.models.base import Model, ModelInfo
from powerlens._src.steering import (alignment_alpha, as_direction, checkpoint_delta, minimal_alpha, optimize_steering,
                                output_effects, parse_direction, principal_alpha, rank1)
from powerlens._src.models.embed import embed_ids, pad_ids
from powerlens._src.steering.effects import forward_final
from powerlens._src.steering.optimize import run_tail
from powerlens._src.steering.rank1 import host_matrices


def real_eigvec(F, target):
    ev, vec = np.linalg.eig(F)
    k = int(np.argmin(np.abs(ev - target)))
    v = np.real(vec[:, k])
    return ev, k, v / np.linalg.norm(v)


@pytest.fixture(scope="module", params=["symmetric", "nonnormal"])
def system(request):
    return S.synthetic_system([2.0, 1.0, -0.5], kind=request.param, heads=2, d=8, seed=1)


# ------------------------------------------------------------------ closed form

def test_eigenvector_moves_by_alpha_rest_unchanged(system):
    _, V, F = host_matrices(system, -1)
    ev, k, u = real_eigvec(F, 1.0)
    alpha = 2.5
    r = rank1(system, u, alpha=alpha, w="inverse")
    np.testing.assert_allclose(r.z, u, atol=1e-10)               # z = V^T pinv(V^T) u = u
    expect = ev.copy()
    expect[k] += alpha
    got = np.linalg.eigvals(r.F_new)
    # match each expected eigenvalue to the nearest computed one (multiset equality)
    for lam in expect:
        assert np.min(np.abs(got - lam)) <= 1e-6 * max(1.0, abs(lam))
    assert abs(r.branch_eigenvalue - (ev[k] + alpha)) <= 1e-6 * abs(ev[k] + alpha)
    # the steered float32 parameters carry the same F' (to float32 rounding)
    F32 = np.asarray(r.layers.W_o[0], np.float64) @ np.asarray(value_matrix(r.layers)[0], np.float64)
    np.testing.assert_allclose(F32, r.F_new, atol=1e-5)
    # ||dO||_F = alpha ||w|| with w = V (V^T V)^-1 u
    w = V @ np.linalg.solve(V.T @ V, u)
    assert r.delta_norm == pytest.approx(alpha * np.linalg.norm(w), rel=1e-12)


def test_inverse_w_is_exact_at_cond_1e8():
    """w='inverse' gives z = V_cat^T w = u at float64 rounding times cond(V_cat), not its
    square: at cond 1e8 the normal equations V (V^T V)^{-1} u lose every digit of z."""
    import jax
    H, e, d = 3, 4, 8
    rng = np.random.default_rng(4)
    P = np.linalg.qr(rng.standard_normal((H * e, d)))[0]           # (H e, d) orthonormal columns
    Q = np.linalg.qr(rng.standard_normal((d, d)))[0]
    V = P @ np.diag(np.logspace(0, -8, d)) @ Q.T                    # cond(V) = 1e8
    u = as_direction(rng.standard_normal(d))
    with jax.enable_x64(True):
        layers = make_layers(V.reshape(1, H, e, d), rng.standard_normal((1, d, H * e)),
                             config=LayerConfig(d_model=d, n_heads=H, d_head=e, norm="l2"))
        assert layers.W_v.dtype == np.float64
        _, Vh, _ = host_matrices(layers, -1)
        assert np.linalg.cond(Vh) == pytest.approx(1e8, rel=1e-3)
        r = rank1(layers, u, alpha=1.0, w="inverse", spectrum=False)
    assert np.max(np.abs(r.z - u)) < 1e-6
    # the minimum-norm solution: w lies in the column space of V_cat
    np.testing.assert_allclose(P @ (P.T @ r.w), r.w, rtol=0, atol=1e-6 * np.linalg.norm(r.w))
    # the normal equations (the old formula) miss by far more than that tolerance
    w_old = Vh @ np.linalg.solve(Vh.T @ Vh, u)
    assert np.max(np.abs(Vh.T @ w_old - u)) > 1e-4


@pytest.mark.parametrize("w", ["inverse", "value"])
def test_asymptotic_eigenpair_matches_eig(system, w):
    rng = np.random.default_rng(3)
    u = as_direction(rng.standard_normal(8))
    errs, verr = [], []
    for alpha in (1e2, 1e3, 1e4):
        r = rank1(system, u, alpha=alpha, w=w)
        lam_exact = r.branch_eigenvalue
        assert abs(lam_exact.imag) < 1e-9 * abs(lam_exact)
        # top in both orderings at large alpha
        assert abs(r.exact_top - lam_exact) < 1e-9 * abs(lam_exact)
        errs.append(abs(r.predicted_eigenvalue - lam_exact.real) / abs(lam_exact))
        verr.append(1.0 - abs(r.predicted_eigenvector @ r.branch_eigenvector))
    # relative error O(1/alpha) (in fact O(1/alpha^2) for the eigenvalue)
    assert errs[1] < 1e-3 and errs[2] < 1e-4
    assert errs[2] < errs[1] / 5 and errs[1] < errs[0] / 5
    assert verr[1] < 1e-3 and verr[2] < 1e-5
    # the eigenvector tends to u: 1 - |cos| = O(1/alpha^2)
    assert 1.0 - abs(r.branch_eigenvector @ u) < 1e-6


def test_checkpoint_delta_layouts():
    rng = np.random.default_rng(0)
    delta = rng.standard_normal((6, 10))
    m = rng.standard_normal((4, 10))           # 4 concatenated-head vectors
    # GPT-2 Conv1D: y = m @ weight with weight (in, out); the change must equal delta m
    np.testing.assert_allclose(m @ checkpoint_delta("gpt2", delta), m @ delta.T)
    assert checkpoint_delta("gpt2", delta).shape == (10, 6)
    # nn.Linear: y = m @ weight.T with weight (out, in)
    np.testing.assert_allclose(m @ checkpoint_delta("llama", delta).T, m @ delta.T)
    with pytest.raises(ValueError, match="family 'mamba'"):
        checkpoint_delta("mamba", delta)
    # a ModelInfo (what a loaded model carries) names its family's layout too
    np.testing.assert_array_equal(checkpoint_delta(ModelInfo(family="gpt2", source="x"), delta), delta.T)


# the steered block's output projection in each transformers model, and its layout in powerlens
_OUT_PROJ = {"gpt2": lambda hf: hf.transformer.h[-1].attn.c_proj.weight,                  # Conv1D (H e, d)
             "gpt_neo": lambda hf: hf.transformer.h[-1].attn.attention.out_proj.weight,    # Linear (d, H e)
             "llama": lambda hf: hf.model.layers[-1].self_attn.o_proj.weight}             # Linear (d, H e)


@pytest.mark.parametrize("kind", sorted(_OUT_PROJ))
def test_checkpoint_delta_steers_transformers_like_powerlens(tmp_path, kind):
    """rank1's delta_O, written into a real tiny transformers model in the family's stored
    layout, gives the hidden states and logits of powerlens's steered model (rule ``full``)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch
    import hf_tiny_decoders as T
    from powerlens._src.models import embed_ids, hidden_states, load, logits

    hf = T.build(kind, str(tmp_path / kind), seed=3, head=True)
    model = load(str(tmp_path / kind))
    ids, mask = T.batch()
    valid = mask.astype(bool)
    x0, vj = embed_ids(model, ids, valid)
    u = as_direction(np.random.default_rng(1).standard_normal(model.layers.config.d_model))
    r = rank1(model.layers, u, alpha=3.0, w="value", layer=-1, spectrum=False)
    steered = model.replace(layers=r.layers)
    steered_hs = hidden_states(steered, x0, vj)
    hs = np.asarray(steered_hs.hf, np.float64)             # transformers' tuple (last state normed)
    lg = np.asarray(logits(steered, steered_hs[-1]), np.float64)
    hs0 = np.asarray(hidden_states(model, x0, vj).hf, np.float64)

    def torch_outputs(stored_delta):
        weight = _OUT_PROJ[kind](hf)
        assert tuple(weight.shape) == stored_delta.shape
        with torch.no_grad():
            weight += torch.tensor(stored_delta, dtype=weight.dtype)
            out = T.hf_hidden_states(hf, ids, mask), T.hf_logits(hf, ids, mask)
            weight -= torch.tensor(stored_delta, dtype=weight.dtype)
        return out

    def err(a, b):
        return float(np.max(np.abs(a[..., valid, :] - b[..., valid, :])) / max(1.0, np.abs(b[..., valid, :]).max()))

    ref_hs, ref_lg = torch_outputs(r.checkpoint_delta(model.info))
    assert err(hs, ref_hs) <= 1e-4 and err(lg, ref_lg) <= 1e-4, (err(hs, ref_hs), err(lg, ref_lg))
    assert err(hs0, ref_hs) > 1e-2                       # the steering changed the last block's output
    # the other layout (a square (d, d) weight here, so it fits) steers transformers differently
    assert r.delta_O.shape[0] == r.delta_O.shape[1]
    wrong = torch_outputs(np.ascontiguousarray(r.checkpoint_delta(model.info).T))[0]
    assert err(hs, wrong) > 1e-2


# ------------------------------------------------------------------ minimal alpha

def test_principal_alpha_closed_form():
    L = S.synthetic_system([2.0, 1.0, -0.5], kind="symmetric", heads=2, d=8, seed=2)
    _, _, F = host_matrices(L, -1)
    ev, k, u = real_eigvec(F, 1.0)
    closed = np.max(np.abs(1 + np.delete(ev, k))) - (1 + ev[k].real)   # = 3 - 2 = 1
    pa = principal_alpha(L, u, rtol=1e-11)
    assert pa.alpha == pytest.approx(closed, rel=1e-6)
    assert pa.cos == pytest.approx(1.0, abs=1e-9)
    # just below: the old top (2) is still principal
    r = rank1(L, u, alpha=closed * (1 - 1e-4))
    assert abs(r.exact_top - 2.0) < 1e-5


@pytest.fixture(scope="module")
def cone():
    L = S.synthetic_system([2.0, 1.0, -0.5], kind="nonnormal", heads=2, d=8, seed=1)
    rng = np.random.default_rng(0)
    c = S.sphere_tokens(rng, 1, 8)[0]
    x0 = np.stack([S.cone_tokens(rng, 6, c, 0.4) for _ in range(2)])
    u = S.cone_tokens(rng, 1, c, 0.9)[0]
    return L, x0, u


def _step_cos(layers, X, u):
    Y = np.stack([np.asarray(layer_step(layers.layer(0), jnp.asarray(x, jnp.float32), jnp.ones(len(x), bool)))
                  for x in X])
    return (Y @ u) / np.linalg.norm(Y, axis=-1)


@pytest.mark.parametrize("w", ["inverse", "value"])
def test_one_step_alignment_relation(cone, w):
    L, x0, u = cone
    aa = alignment_alpha(L, x0, u, target=0.99, w=w)
    assert aa.alpha > 0
    cos = _step_cos(rank1(L, u, alpha=aa.alpha, w=w).layers, x0, u)
    assert cos.min() == pytest.approx(0.99, abs=1e-5)
    assert tuple(np.unravel_index(np.argmin(cos), cos.shape)) == aa.worst
    # slightly smaller alpha misses the target
    assert _step_cos(rank1(L, u, alpha=0.999 * aa.alpha, w=w).layers, x0, u).min() < 0.99 - 1e-6
    # the relation holds per token and at any alpha
    for a in (0.3 * aa.alpha, 2.0 * aa.alpha):
        np.testing.assert_allclose(_step_cos(rank1(L, u, alpha=a, w=w).layers, x0, u), aa.cos(a), atol=2e-6)


def test_minimal_alpha_multilayer(cone):
    """Two different layers: the steered last layer sees the output of the first."""
    L1, x0, u = cone
    L0 = S.synthetic_system([1.5, -0.3], kind="normal", heads=2, d=8, seed=7)
    cat = lambda a, b: None if a is None else np.concatenate([np.asarray(a), np.asarray(b)])
    two = make_layers(cat(L0.W_v, L1.W_v), cat(L0.W_o, L1.W_o), W_q=cat(L0.W_q, L1.W_q), W_k=cat(L0.W_k, L1.W_k),
                      scale=cat(L0.scale, L1.scale), config=LayerConfig(d_model=8, n_heads=2, d_head=4, norm="l2"))
    ma = minimal_alpha(two, u, x0, target=0.95)
    assert ma.principal.alpha > 0 and ma.principal.cos >= 0.95
    steered = rank1(two, u, alpha=ma.alignment.alpha).layers
    Y = np.asarray(run_tail(steered, jnp.asarray(x0, jnp.float32), jnp.ones(x0.shape[:2], bool), (0, 1),
                            rule="paper", attention="softmax", keep_bias=False))
    cos = (Y @ u) / np.linalg.norm(Y, axis=-1)
    assert cos.min() == pytest.approx(0.95, abs=1e-5)
    with pytest.raises(ValueError, match="applied at steps"):
        minimal_alpha(L1.with_schedule((0, 0)), u, x0)


def test_alignment_alpha_infeasible_names_token():
    L = S.synthetic_system([2.0, 1.0, -0.5], kind="nonnormal", heads=2, d=8, seed=1)
    rng = np.random.default_rng(0)
    x0 = S.sphere_tokens(rng, 6, 8)
    u = S.sphere_tokens(rng, 1, 8)[0]
    with pytest.raises(ValueError, match=r"token \(0, \d\).*s = w\.m"):
        alignment_alpha(L, x0, u, target=0.99, w="inverse")


# ------------------------------------------------------------------ gradient steering

@pytest.fixture(scope="module")
def grad_problem():
    L = S.synthetic_system([2.0, 1.0, -0.5], kind="nonnormal", heads=4, d=16, seed=1)
    rng = np.random.default_rng(0)
    c = S.sphere_tokens(rng, 1, 16)[0]
    x0 = np.stack([S.cone_tokens(rng, 8, c, 0.4) for _ in range(3)])
    D = S.cone_tokens(rng, 3, c, 0.9)
    return L, x0, D


@pytest.mark.parametrize("param,rank", [("w_alpha", 1), ("lowrank", 2)])
def test_gradient_beats_closed_form(grad_problem, param, rank):
    L, x0, D = grad_problem
    target = 0.95
    res = optimize_steering(L, x0, D, target=target, reduce="min", param=param, rank=rank, steps=200)
    assert res.feasible.all() and res.closed_feasible.all()
    for i, u in enumerate(D):
        # closed form at equal alignment = the exact one-step alpha times ||w||
        aa = alignment_alpha(L, x0, u, target=target)
        assert res.closed_norm[i] == pytest.approx(aa.alpha * np.linalg.norm(aa.w), rel=1e-4)
        # re-simulate the returned perturbation independently of the optimiser
        Lp = L.replace(W_o=L.W_o.at[0].add(jnp.asarray(res.delta_O[i])))
        assert np.linalg.matrix_rank(res.delta_O[i], tol=1e-4 * res.norm[i]) <= rank
        cos = _step_cos(Lp, x0, u)
        assert cos.min() >= target - 1e-3
        assert cos.min() == pytest.approx(res.alignment[i], abs=1e-5)
        assert np.linalg.norm(res.delta_O[i]) == pytest.approx(res.norm[i], rel=1e-5)
        assert res.norm[i] <= res.closed_norm[i]
    assert np.median(res.norm_ratio) < 0.5     # far below the closed form here


# ------------------------------------------------------------------ effects (tiny decoder, NumPy reference)

def _rms(x, s, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * s


def _np_forward(P, ids, W_o, add=None):
    """Reference pre-norm decoder block (no RoPE), SiLU-GLU FFN; returns (final h, block output)."""
    x = P["word"][ids]                                        # (n, d)
    a = _rms(x, P["n1"], P["eps"])
    n = len(ids)
    outs = []
    for h in range(P["H"]):
        q, k, v = a @ P["Wq"][h].T, a @ P["Wk"][h].T, a @ P["Wv"][h].T
        s = q @ k.T / np.sqrt(q.shape[1])
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
        A = np.exp(s - s.max(1, keepdims=True))
        A /= A.sum(1, keepdims=True)
        outs.append(A @ v)
    hres = x + np.concatenate(outs, 1) @ W_o.T
    b = _rms(hres, P["n2"], P["eps"])
    g = b @ P["Wg"].T
    y = hres + ((g / (1 + np.exp(-g))) * (b @ P["Wi"].T)) @ P["Wout"].T
    return (y if add is None else y + add), y


def _np_logp(P, h):
    z = _rms(h, P["nf"], P["eps"]) @ P["word"].T
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def tiny_decoder():
    rng = np.random.default_rng(5)
    d, H, e, f, V, eps = 8, 2, 4, 12, 11, 1e-6
    P = {"word": rng.standard_normal((V, d)), "n1": 1 + 0.1 * rng.standard_normal(d),
         "n2": 1 + 0.1 * rng.standard_normal(d), "nf": 1 + 0.1 * rng.standard_normal(d),
         "Wq": rng.standard_normal((H, e, d)) / 2, "Wk": rng.standard_normal((H, e, d)) / 2,
         "Wv": rng.standard_normal((H, e, d)) / 2, "Wo": rng.standard_normal((d, H * e)) / 3,
         "Wi": rng.standard_normal((f, d)) / 3, "Wg": rng.standard_normal((f, d)) / 3,
         "Wout": rng.standard_normal((d, f)) / 3, "H": H, "eps": eps}
    cfg = LayerConfig(d_model=d, n_heads=H, d_head=e, causal=True, norm="rmsnorm", norm_eps=eps,
                      norm_placement="pre", ffn_activation="silu_glu")
    f32 = lambda a: np.asarray(a, np.float32)[None]
    layers = make_layers(f32(P["Wv"]), f32(P["Wo"]), W_q=f32(P["Wq"]), W_k=f32(P["Wk"]), config=cfg,
                         norm_scale=f32(P["n1"]), ffn_norm_scale=f32(P["n2"]), W_in=f32(P["Wi"]),
                         W_gate=f32(P["Wg"]), W_out=f32(P["Wout"]))
    model = Model(layers=layers, embeddings={"word": jnp.asarray(P["word"], jnp.float32)},
                  final_norm_scale=jnp.asarray(P["nf"], jnp.float32), lm_head=None,
                  info=ModelInfo(family="llama", source="synthetic", decoder=True, name="tiny"))
    return model, P


def test_effects_of_several_changes_equal_the_separate_calls(tiny_decoder):
    """A mapping of changes runs "before" once; each change's effects are those of its own call
    (the numbers agree to float32 rounding: the batch is the same, prompts and neutral together)."""
    model, P = tiny_decoder
    u = as_direction(P["word"][7])
    prompts, neutral = [[1, 4, 2, 9, 3], [5, 6, 10]], [[3, 1, 4, 1, 5, 9, 2, 6]]
    deltas = {"a": rank1(model.layers, u, alpha=3.0, w="value").delta_O,
              "b": rank1(model.layers, u, alpha=0.5, w="value").delta_O}
    both = output_effects(model, u, deltas, prompts, target_id=7, k=3, neutral=neutral)
    assert set(both) == {"a", "b"}
    assert both["a"]["conditions"]["before"] == both["b"]["conditions"]["before"]
    for name, delta in deltas.items():
        one = output_effects(model, u, delta, prompts, target_id=7, k=3, neutral=neutral)
        assert one["beta"] == pytest.approx(both[name]["beta"], rel=1e-6)
        for cond in ("before", "rank1", "activation_addition"):
            x, y = one["conditions"][cond], both[name]["conditions"][cond]
            assert x["perplexity"] == pytest.approx(y["perplexity"], rel=1e-6)
            np.testing.assert_allclose(x["target_prob"], y["target_prob"], rtol=1e-6)
    assert both["a"]["beta"] > both["b"]["beta"]          # the larger change moves the layer output more


def test_effects_match_numpy_reference(tiny_decoder):
    model, P = tiny_decoder
    u = as_direction(P["word"][7])                 # unembedding direction of token 7 (tied)
    prompts = [[1, 4, 2, 9, 3], [5, 6, 10]]
    neutral = [[3, 1, 4, 1, 5, 9, 2, 6]]
    r = rank1(model.layers, u, alpha=3.0, w="value")
    eff = output_effects(model, u, r.delta_O, prompts, target_id=7, k=3, neutral=neutral)
    Wo1 = P["Wo"] + r.delta_O
    # beta = mean ||change of the block output|| over tokens
    changes = np.concatenate([np.linalg.norm(_np_forward(P, p, Wo1)[1] - _np_forward(P, p, P["Wo"])[1], axis=1)
                              for p in prompts])
    assert eff["beta"] == pytest.approx(changes.mean(), rel=1e-4)
    beta = eff["beta"]
    for name, Wo, add in (("before", P["Wo"], None), ("rank1", Wo1, None),
                          ("activation_addition", P["Wo"], beta * u)):
        c = eff["conditions"][name]
        for b, p in enumerate(prompts):
            h, _ = _np_forward(P, p, Wo, add)
            lp = _np_logp(P, h[-1])
            assert c["target_prob"][b] == pytest.approx(np.exp(lp[7]), rel=1e-4, abs=1e-7)
            assert [t["id"] for t in c["topk"][b]] == list(np.argsort(-lp)[:3])
            pooled = h.mean(0)
            assert c["pooled_cos"][b] == pytest.approx(pooled @ u / np.linalg.norm(pooled), abs=1e-5)
        hn, _ = _np_forward(P, neutral[0], Wo, add)
        lpn = _np_logp(P, hn)
        nll = -np.mean([lpn[t, neutral[0][t + 1]] for t in range(len(neutral[0]) - 1)])
        assert c["perplexity"] == pytest.approx(np.exp(nll), rel=1e-4)
    # activation addition at the last block shifts the final state by exactly beta u
    assert eff["conditions"]["activation_addition"]["alignment"] > eff["conditions"]["before"]["alignment"]
    ids, valid = pad_ids(prompts)
    x0, vj = embed_ids(model, ids, valid)
    h0 = np.asarray(forward_final(model, x0, vj)[0], np.float64)
    h2 = np.asarray(forward_final(model, x0, vj, add=beta * u)[0], np.float64)
    # float32: h2 = fl(h0 + fl(beta u)), so each entry is off by at most one rounding of each sum
    eps32 = np.finfo(np.float32).eps
    bound = eps32 * (np.abs(h0) + beta * np.abs(u) + np.abs(h2))
    assert np.all(np.abs(h2 - h0 - beta * u)[valid] <= bound[valid])
    # and the reported alignment is the mean cos(h0 + beta u, u) of the valid final tokens
    shifted = h0 + beta * u
    cos = (shifted @ u) / np.linalg.norm(shifted, axis=-1)
    # a perturbation of norm <= ||bound|| moves cos(h, u) by at most 2 ||bound|| / ||h||
    tol = 2 * np.max(np.linalg.norm(bound, axis=-1) / np.linalg.norm(shifted, axis=-1))
    assert eff["conditions"]["activation_addition"]["alignment"] == pytest.approx(cos[valid].mean(), abs=tol)
    assert eff["conditions"]["before"]["alignment"] == pytest.approx(
        ((h0 @ u) / np.linalg.norm(h0, axis=-1))[valid].mean(), abs=tol)


# ------------------------------------------------------------------ bad input

def test_bad_directions(tmp_path, system):
    with pytest.raises(ValueError, match="zero vector"):
        as_direction(np.zeros(8), 8)
    with pytest.raises(ValueError, match="non-finite"):
        as_direction([1.0, np.nan] + [0.0] * 6, 8)
    with pytest.raises(ValueError, match="dimension 5 but the model width is d=8"):
        rank1(system, np.ones(5), alpha=1.0)
    with pytest.raises(ValueError, match="zero vector"):
        rank1(system, np.zeros(8), alpha=1.0)
    with pytest.raises(ValueError, match="non-finite"):
        optimize_steering(system, np.ones((1, 3, 8)), np.full(8, np.inf))
    np.save(tmp_path / "u.npy", np.arange(8.0))
    dirn = parse_direction(str(tmp_path / "u.npy"), d=8)
    np.testing.assert_allclose(dirn.vector, np.arange(8.0) / np.linalg.norm(np.arange(8.0)))
    np.save(tmp_path / "bad.npy", np.ones(3))
    with pytest.raises(ValueError, match=r"bad\.npy.*dimension 3.*d=8"):
        parse_direction(str(tmp_path / "bad.npy"), d=8)
    with pytest.raises(ValueError, match="does not exist"):
        parse_direction(str(tmp_path / "missing.npy"), d=8)
    with pytest.raises(ValueError, match="needs a model"):
        parse_direction("token:king", d=8)
    with pytest.raises(ValueError, match="unknown direction"):
        parse_direction("north", d=8)
    a, b = parse_direction("random", d=8, seed=3).vector, parse_direction("random", d=8, seed=3).vector
    np.testing.assert_array_equal(a, b)
    assert np.linalg.norm(a) == pytest.approx(1.0)


@pytest.mark.parametrize("alpha", [0.0, -1.0, float("nan"), float("inf"), "big"])
def test_bad_alpha(system, alpha):
    with pytest.raises(ValueError, match="alpha must be"):
        rank1(system, np.ones(8), alpha=alpha)


@pytest.mark.parametrize("target", [0.0, 1.0, -0.2, 1.5, float("nan")])
def test_bad_target(cone, target):
    L, x0, u = cone
    with pytest.raises(ValueError, match="target alignment must lie strictly between 0 and 1"):
        alignment_alpha(L, x0, u, target=target)
    with pytest.raises(ValueError, match="target alignment must lie strictly between 0 and 1"):
        optimize_steering(L, x0, u, target=target)


def test_bad_options(system):
    with pytest.raises(ValueError, match="unknown w 'magic'"):
        rank1(system, np.ones(8), alpha=1.0, w="magic")
    with pytest.raises(ValueError, match=r"w must have shape \(8,\)"):
        rank1(system, np.ones(8), alpha=1.0, w=np.ones(3))
    with pytest.raises(ValueError, match="layer 3 is out of range"):
        rank1(system, np.ones(8), alpha=1.0, layer=3)
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        optimize_steering(system, np.ones((1, 3, 8)), np.ones(8), rank=0)
    with pytest.raises(ValueError, match="unknown param"):
        optimize_steering(system, np.ones((1, 3, 8)), np.ones(8), param="full")
