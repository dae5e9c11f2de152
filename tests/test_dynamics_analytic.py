"""Analytic cases of the token dynamics, spectra and measures, checked in float64.

Notation: the ``paper`` rule with uniform attention over n tokens (no mask) is

    x_i <- N2(x_i + F xbar),   xbar = (1/n) sum_j x_j,

because attn(X)_i = sum_h O_h V_h (A X)_i = F xbar when every A row is 1/n. Write
x_i = xbar + delta_i (sum_i delta_i = 0). Then x_i + F xbar = delta_i + (I + F) xbar:
the common part takes one power step on I + F while the deviations are untouched
before the normalisation. Every expected number below follows from that line.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special, stats

from powerlens._src.analysis import measures as M
from powerlens._src.dynamics import measures as DM
from powerlens._src.analysis.spectra import layer_spectra, reference_subspaces
from powerlens._src.dynamics.layer import layer_step
from powerlens._src.dynamics.params import LayerConfig, make_layers
from powerlens._src.dynamics.simulate import pooled, simulate_batch, simulate_jit
from powerlens._src.dynamics.linalg import haar
from powerlens._src.dynamics.synthetic import cone_tokens, sphere_tokens, synthetic_system


pytestmark = pytest.mark.usefixtures("x64")   # float64 for this module only (tests/conftest.py)


def _sym(eigs, seed=0):
    """F = Q diag(eigs) Q^T with a Haar Q; returns F and Q (columns = eigenvectors)."""
    Q = haar(np.random.default_rng(seed).standard_normal((len(eigs), len(eigs))))
    return Q @ np.diag(eigs) @ Q.T, Q


def _run(F, x0, steps, *, attention="uniform", heads=1, seed=0, order="shifted", save_states=True,
         measure_after=False):
    layers = synthetic_system(None, F=F, heads=heads, seed=seed, steps=steps, dtype=np.float64)
    assert layers.W_v.dtype == jnp.float64          # float64 honoured end to end
    sub = reference_subspaces(layer_spectra(F), order=order, dtype=jnp.float64)
    traj = simulate_jit(layers, jnp.asarray(x0, jnp.float64), sub, rule="paper", attention=attention,
                        save_states=save_states, measure_after=measure_after)
    assert traj.final.dtype == jnp.float64
    return traj, layers, sub


def _tan(xbar, v):
    """tan of the angle between the line of v (unit) and xbar."""
    c = xbar @ v
    return np.linalg.norm(xbar - c * v) / abs(c)


# ------------------------------------------------------------------ consensus and direction

def test_uniform_symmetric_consensus_and_direction_rates():
    """Symmetric F, eigenvalues 3, 2, -2.5, 0.5, 0.2, -0.1 (shifted keys |1+l|: 4, 3, 1.5, ...).

    Consensus: near consensus, with c = xbar and N = ||(I+F)c||, the normalised token is
    u + (I - u u^T) delta_i / N + O(delta^2), u = (I+F)c/N: the deviations shrink by 1/N,
    and N -> |1 + lambda1| = 4 once xbar ~ v1. So mu_{t+1}/mu_t -> 1/4.
    Direction: xbar follows the power method on I + F (the deviations enter at second
    order), so tan angle(xbar, v1) shrinks by |1+lambda2|/|1+lambda1| = 3/4 per step
    (the plain ordering would predict |-2.5|/3 = 0.83 instead).
    Corrections: (3/4)^(2t) for the consensus rate, (1.5/3)^t for the direction.
    """
    F, Q = _sym([3.0, 2.0, -2.5, 0.5, 0.2, -0.1], seed=1)
    rng = np.random.default_rng(2)
    w = Q[:, 0] + 0.3 * (Q[:, 1] + Q[:, 2] + Q[:, 3])            # tan angle(w, v1) = 0.52
    x0 = cone_tokens(rng, 8, w, 0.3)
    traj, _, _ = _run(F, x0, 60)
    mu = np.asarray(traj.consensus)
    S = np.asarray(traj.states)
    ratios = mu[1:17] / mu[:16]           # later steps reach consensus exactly (mu = 0)
    # first order, step by step: mu_{t+1}/mu_t = 1/N_t with N_t = ||(I+F) xbar_t|| / ||xbar_t||
    xb = S.mean(1)
    N = np.linalg.norm(xb + xb @ F.T, axis=1) / np.linalg.norm(xb, axis=1)
    np.testing.assert_allclose(ratios[3:16], 1 / N[3:16], rtol=1e-3)
    # asymptotically N_t -> |1 + lambda1| = 4
    np.testing.assert_allclose(ratios[8:16], 0.25, rtol=1e-2)
    fit = np.exp(np.polyfit(np.arange(8, 16), np.log(mu[8:16]), 1)[0])
    assert abs(fit - 0.25) < 2.5e-3
    S = np.asarray(traj.states)
    tans = np.array([_tan(s.mean(0), Q[:, 0]) for s in S])
    np.testing.assert_allclose(tans[13:51] / tans[12:50], 0.75, rtol=1e-2)
    fit = np.exp(np.polyfit(np.arange(12, 51), np.log(tans[12:51]), 1)[0])
    assert abs(fit - 0.75) < 1e-3
    # gamma against the shifted principal subspace -> 1 (1 - gamma ~ tan^2 / 2)
    assert 1 - float(traj.gamma[-1, 0]) < 1e-6


# -------------------------------------------------------------------------- complex pair

@pytest.mark.parametrize("measure_after", [False, True])
@pytest.mark.parametrize("kind", ["normal", "nonnormal"])
def test_complex_pair_rotation(kind, measure_after):
    """Dominant pair lambda1 = 0.5 + 1.2j (others 0.3, -0.2, 0.1, 0.25; |1+l| <= 1.3 < 1.92).

    At consensus the tokens take power steps on I + F, which on the invariant plane acts
    (in spectra's oriented Schur basis) as |1+lambda1| times a rotation by
    arg(1+lambda1) = atan2(1.2, 1.5) = 0.6747 rad for a normal F. Hence rotation[t] ->
    arg(1+lambda1) > 0, gamma -> 1 and ||(I+F) xbar|| / ||xbar|| -> |1+lambda1| = 1.9209.
    Non-normal F: the restriction T2 is only similar to a rotation, so the angle per step
    varies along the orbit, but its long-run mean (the rotation number) is still
    arg(1+lambda1); amplitude ratios average to |1+lambda1| in the log. The same holds
    measuring all 201 states after the scan (``measure_after``).
    """
    lam = 0.5 + 1.2j
    from powerlens._src.dynamics.synthetic import spectrum_matrix
    F = spectrum_matrix([lam, 0.3, -0.2, 0.1, 0.25], kind=kind, d=6, seed=3, nonnormality=0.5)
    rng = np.random.default_rng(4)
    traj, _, sub = _run(F, sphere_tokens(rng, 5, 6), 200, measure_after=measure_after)
    theta = math.atan2(1.2, 1.5)
    rot = np.asarray(traj.rotation)
    S = np.asarray(traj.states)
    xbar = S[100:].mean(1)
    amp = np.linalg.norm(xbar + xbar @ F.T, axis=1) / np.linalg.norm(xbar, axis=1)
    assert int(sub.dim[0, 0]) == 2
    if kind == "normal":
        np.testing.assert_allclose(rot[-20:], theta, atol=1e-9)
        np.testing.assert_allclose(amp, abs(1 + lam), rtol=1e-9)
    else:
        assert abs(rot[100:].mean() - theta) < 0.02
        assert abs(np.exp(np.log(amp[:-1]).mean()) - abs(1 + lam)) < 0.05 * abs(1 + lam)
    assert 1 - float(traj.gamma[-1, 0]) < 1e-9
    assert float(traj.consensus[-1]) < 1e-9


@pytest.mark.parametrize("measure_after", [False, True])
def test_rotation_near_pi_straddling_the_cut(measure_after):
    """I + F = [[1.05 R(theta), C], [0, diag(0.6, -0.4)]] in R^4, theta = pi - 0.03, C a fixed
    coupling: the plane span(e1, e2) is invariant with |1 + lambda1| = 1.05 > 0.6, so it is
    the principal (complex-pair) subspace. With identity attention each token takes its own
    step x <- (I + F)x / ||(I + F)x||, and the coupling from the decaying e3, e4 parts spreads
    the tokens' angle steps in the plane by up to 2.3 rad around a mean near pi: in steps
    1-6 some steps wrap to just below +pi and others to just above -pi. The rotation of each step is the mean of
    the steps s_i read on one branch, wrap(c + mean_i wrap(s_i - c)) with c = arg sum_i e^{i s_i}
    (its plain mean of wrapped steps is off by up to 2.7 rad there), and once the tokens are
    in the plane it is theta, the angle of 1 + lambda1, to rounding."""
    theta = math.pi - 0.03
    M = np.zeros((4, 4))
    M[:2, :2] = 1.05 * np.array([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]])
    M[2:, 2:] = np.diag([0.6, -0.4])
    M[:2, 2:] = [[2.0, -1.0], [1.0, 2.5]]
    traj, _, sub = _run(M - np.eye(4), np.random.default_rng(0).standard_normal((16, 4)), 40,
                        attention="identity", measure_after=measure_after)
    assert int(sub.dim[0, 0]) == 2
    B = np.asarray(sub.basis[0, 0])[:, :2]
    S = np.asarray(traj.states)
    wrap = lambda a: (a + np.pi) % (2 * np.pi) - np.pi
    steps = np.diff(np.arctan2(S @ B[:, 1], S @ B[:, 0]), axis=0)        # (T, n), in (-2 pi, 2 pi)
    ws = wrap(steps)
    straddles = (ws.max(1) > 2.5) & (ws.min(1) < -2.5)
    assert straddles[1:7].all()
    c = np.angle(np.exp(1j * steps).sum(1))
    expected = wrap(c + wrap(steps - c[:, None]).mean(1))
    rot = np.asarray(traj.rotation)
    np.testing.assert_allclose(wrap(rot - expected), 0.0, atol=1e-12)
    assert np.abs(wrap(ws.mean(1) - expected))[straddles].max() > 1.0     # what the plain mean gives
    # the tokens end in the plane, where I + F rotates by arg(1 + lambda1) = theta
    np.testing.assert_allclose(rot[-5:], theta, atol=1e-9)
    assert np.all((-np.pi <= rot) & (rot < np.pi))


# ------------------------------------------------------------------ repeated top eigenvalue

def test_repeated_top_eigenvalue_subspace():
    """F = Q diag(2, 2, 0.3, 0.1, -0.2) Q^T: the principal object is span(Q[:, :2]), so spectra
    must return dim 2 with projector Q2 Q2^T (any basis of it). Tokens converge into it at
    rate 1.3/3 per step, so gamma against it -> 1."""
    F, Q = _sym([2.0, 2.0, 0.3, 0.1, -0.2], seed=5)
    sp = layer_spectra(F)[0]
    P_true = Q[:, :2] @ Q[:, :2].T
    for o in (sp.shifted, sp.plain):
        assert o.dim == 2
        np.testing.assert_allclose(o.basis @ o.basis.T, P_true, atol=1e-10)
        assert not o.is_complex
        assert abs(o.ratio - (1.3 / 3 if o is sp.shifted else 0.3 / 2)) < 1e-10
    rng = np.random.default_rng(6)
    traj, _, _ = _run(F, sphere_tokens(rng, 6, 5), 40)
    assert 1 - float(traj.gamma[-1, 0]) < 1e-12
    assert np.all(np.isnan(np.asarray(traj.rotation)))   # a real 2-D subspace: no rotation


def test_defective_and_near_repeated_top():
    """A Jordan block J = [[2, 1], [0, 2]] (defective) and a near-repeated pair (2, 2 - 1e-7)
    are both handled as the 2-D invariant subspace: span(S[:, :2]) for F = S J' S^-1."""
    rng = np.random.default_rng(7)
    S = np.eye(5) + 0.4 * rng.standard_normal((5, 5))
    for top in ([[2.0, 1.0], [0.0, 2.0]], [[2.0, 0.0], [0.0, 2.0 - 1e-7]]):
        D = np.zeros((5, 5))
        D[:2, :2] = top
        D[2:, 2:] = np.diag([0.3, -0.1, 0.2])
        F = S @ D @ np.linalg.inv(S)
        sp = layer_spectra(F)[0].shifted
        assert sp.dim == 2
        Qs, _ = np.linalg.qr(S[:, :2])
        np.testing.assert_allclose(sp.basis @ sp.basis.T, Qs @ Qs.T, atol=1e-6)


# ------------------------------------------------------------------ low-rank F = A B

def _low_rank(eigs, d, seed):
    """F = A B with B A = S diag(eigs) S^-1 (r = len(eigs) < d): the nonzero eigenvalues of F
    are exactly ``eigs`` and the other d - r are 0, with eigenspace null(B)."""
    rng = np.random.default_rng(seed)
    r = len(eigs)
    B = rng.standard_normal((r, d))
    S = np.eye(r) + 0.3 * rng.standard_normal((r, r))
    M = S @ np.diag(eigs) @ np.linalg.inv(S)
    A = B.T @ np.linalg.solve(B @ B.T, M)          # B A = M
    return A, B


@pytest.mark.parametrize("eigs", [[2.5, -1.9, 0.7, 0.3, -0.2, 0.1], [-0.6, -1.3, -0.4, -1.5]])
def test_factored_spectra_match_the_full_eig(eigs):
    """``layer_spectra(F, factors=(A, B))`` (eig of the r x r matrix B A) against the full eig of
    F = A B: the same eigenvalues, groups, keys and principal subspaces. In the second case
    every nonzero eigenvalue has |1 + lambda| < 1, so in the shifted ordering the principal
    group is the d - r zeros (key 1) and its subspace is null(B), of dimension d - r."""
    d = 14
    A, B = _low_rank(eigs, d, seed=11)
    F = A @ B
    full, = layer_spectra(F)
    fact, = layer_spectra(F, factors=(A[None], B[None]))
    for order in ("shifted", "plain"):
        x, y = full.get(order), fact.get(order)
        assert (x.dim, x.is_complex) == (y.dim, y.is_complex)
        np.testing.assert_allclose(y.eigenvalues[:len(eigs)], x.eigenvalues[:len(eigs)], atol=1e-9)
        np.testing.assert_allclose([y.mu1, y.mu2], [x.mu1, x.mu2], atol=1e-9)
        np.testing.assert_allclose(y.basis @ y.basis.T, x.basis @ x.basis.T, atol=1e-8)
        np.testing.assert_allclose(F @ y.basis, y.basis @ (y.basis.T @ F @ y.basis), atol=1e-8)  # invariant
    lam = np.array(eigs)
    if np.all(np.abs(1 + lam) < 1):
        sp = fact.shifted
        assert sp.dim == d - len(eigs) and sp.mu1 == 1.0
        assert np.max(np.abs(B @ sp.basis)) < 1e-10                   # null(B)
        np.testing.assert_allclose(sp.mu2, np.max(np.abs(1 + lam)), rtol=1e-12)
    else:
        k = np.argmax(np.abs(1 + lam))
        np.testing.assert_allclose(fact.shifted.top, lam[k], rtol=1e-12)
        np.testing.assert_allclose(fact.shifted.ratio, np.sort(np.abs(1 + lam))[-2] / np.abs(1 + lam[k]),
                                   rtol=1e-12)


def test_layer_factors_of_grouped_query_attention():
    """W_o summed over the query heads of each key/value head, times W_v of the G heads, is
    F = W_o V_cat with V repeated over the groups (H = 6 query heads on G = 2)."""
    from powerlens._src.analysis.spectra import spectra_of
    from powerlens._src.dynamics.params import layer_factors, layer_matrices
    rng = np.random.default_rng(12)
    U, H, G, e, d = 2, 6, 2, 3, 16
    cfg = LayerConfig(d_model=d, n_heads=H, n_kv_heads=G, d_head=e, norm="l2")
    layers = make_layers(rng.standard_normal((U, G, e, d)), rng.standard_normal((U, d, H * e)), config=cfg)
    A, B = (np.asarray(m, np.float64) for m in layer_factors(layers))
    assert A.shape == (U, d, G * e) and B.shape == (U, G * e, d)
    F = np.asarray(layer_matrices(layers), np.float64)
    np.testing.assert_allclose(A @ B, F, rtol=1e-5, atol=1e-5)
    for x, y in zip(layer_spectra(F), spectra_of(layers)):
        assert x.shifted.dim == y.shifted.dim
        np.testing.assert_allclose(y.shifted.eigenvalues[:G * e], x.shifted.eigenvalues[:G * e], atol=1e-4)
        np.testing.assert_allclose(y.shifted.basis @ y.shifted.basis.T, x.shifted.basis @ x.shifted.basis.T,
                                   atol=1e-5)


# ----------------------------------------------------------------- negative dominant eigenvalue

def test_negative_dominant_orderings_differ():
    """Eigenvalues -3, 1.5, 0.5, 0.2, -0.4. Plain order: -3 first; shifted: 1.5 first
    (|1+1.5| = 2.5 > |1-3| = 2). Tokens follow the shifted principal vector v(1.5): tan of
    the angle falls at 2/2.5 = 0.8 per step (the plain reading would predict
    convergence to v(-3)), and the component along v(-3) vanishes."""
    F, Q = _sym([-3.0, 1.5, 0.5, 0.2, -0.4], seed=8)
    sp = layer_spectra(F)[0]
    assert sp.orderings_differ
    assert abs(sp.plain.top - (-3)) < 1e-10 and abs(sp.shifted.top - 1.5) < 1e-10
    assert abs(sp.shifted.ratio - 0.8) < 1e-10
    rng = np.random.default_rng(9)
    traj, _, _ = _run(F, sphere_tokens(rng, 6, 5), 150)
    S = np.asarray(traj.states)
    tans = np.array([_tan(s.mean(0), Q[:, 1]) for s in S])
    np.testing.assert_allclose(tans[31:61] / tans[30:60], 0.8, rtol=1e-2)
    assert 1 - float(traj.gamma[-1, 0]) < 1e-12
    assert np.abs(S[-1] @ Q[:, 0]).max() < 1e-10
    # against the plain principal subspace v(-3) the same tokens have gamma ~ 0
    plain = reference_subspaces(layer_spectra(F), order="plain", dtype=jnp.float64)
    g = np.asarray(DM.token_alignment(jnp.asarray(S[-1]), plain.basis[0, 0]))
    assert g.max() < 1e-10


def test_negative_dominant_sign_flip():
    """Eigenvalues -3, 0.2, -0.1, 0.3, 0: shifted top is -3 (|1-3| = 2 > 1.3), 1 + lambda1 = -2 < 0,
    so each step maps xbar ~ v1 to (I+F)v1 / 2 = -v1: cos(xbar_t, v1) alternates in sign and
    |cos| -> 1 (rate 1.3/2). The principal subspace is 1-D, so rotation is undefined (NaN)."""
    F, Q = _sym([-3.0, 0.2, -0.1, 0.3, 0.0], seed=10)
    sp = layer_spectra(F)[0]
    assert not sp.orderings_differ and abs(sp.shifted.top + 3) < 1e-10
    rng = np.random.default_rng(11)
    traj, _, _ = _run(F, cone_tokens(rng, 6, rng.standard_normal(5), 0.5), 60)
    S = np.asarray(traj.states)
    cos = np.array([s.mean(0) @ Q[:, 0] / np.linalg.norm(s.mean(0)) for s in S])
    assert np.all(np.sign(cos[11:]) == -np.sign(cos[10:-1]))
    assert 1 - abs(cos[-1]) < 1e-10
    # every token flips too
    assert np.all(np.sign(S[-1] @ Q[:, 0]) == -np.sign(S[-2] @ Q[:, 0]))
    assert np.all(np.isnan(np.asarray(traj.rotation)))


# ---------------------------------------------------------------------------- anti-consensus

@pytest.mark.parametrize("eigs", [[-0.5] * 4, [-0.6, -0.8, -1.2, -1.4]])
def test_anti_consensus(eigs):
    """All |1 + lambda| < 1 (here 0.5, or 0.4..0.4 for -0.6..-1.4).

    Near consensus the deviations grow by 1/N, N = ||(I+F)xbar|| (< 1): for F = -I/2,
    N = 1/2 so mu doubles per step while mu is small. Then mu -> 1 (the tokens spread to a
    configuration a_i with mean 0). Linearising around such a fixed configuration
    (x_i = a_i + e_i, e_i tangent): e_i' = e_i + P_i F ebar, P_i = I - a_i a_i^T, so
    ebar' = K ebar with K = I + (I - C) F, C = (1/n) sum a_i a_i^T. The mean norm then
    shrinks by rho(K) per step. For F = -I/2, K = (I + C)/2: the brief's |1 + lambda1| = 1/2
    is only the lower bound, reached when C -> 0 (tokens spread over many dimensions).
    Since mu^2 = 1 - ||xbar||^2 for unit rows, 1 - mu ~ ||xbar||^2 / 2.
    """
    d, n = 4, 6
    F, _ = _sym(eigs, seed=12)
    rng = np.random.default_rng(13)
    x0 = cone_tokens(rng, n, rng.standard_normal(d), 1e-7)
    traj, _, _ = _run(F, x0, 160)
    mu = np.asarray(traj.consensus)
    if eigs[0] == -0.5:
        np.testing.assert_allclose(mu[1:8] / mu[:7], 2.0, rtol=1e-2)
    assert np.all(np.diff(mu) > -1e-12)
    S = np.asarray(traj.states)
    a = S[-1]
    C = a.T @ a / n
    K = np.eye(d) + (np.eye(d) - C) @ F
    rate = np.max(np.abs(np.linalg.eigvals(K)))
    m = np.linalg.norm(S.mean(1), axis=1)
    late = np.flatnonzero((m < 1e-3) & (m > 1e-11))
    assert late.size > 10
    got = m[late[-1]] / m[late[-1] - 1]
    assert abs(got - rate) < 1e-2 * rate
    if eigs[0] == -0.5:
        assert rate > 0.5 + 0.5 / d - 1e-9          # C has trace 1 so its top eigenvalue >= 1/d
    assert abs((1 - mu[late[-1]]) - m[late[-1]] ** 2 / 2) < 1e-3 * m[late[-1]] ** 2 + 1e-15


# ------------------------------------------------------------------------ bipartite fixed points

def _bip_layers(F, heads, seed, scale=None, c_target=None):
    rng = np.random.default_rng(seed)
    d = F.shape[0]
    split = synthetic_system(None, F=F, heads=heads, d_head=d, seed=seed, dtype=np.float64)
    W_v, W_o = split.W_v[0], split.W_o[0]
    W_q = rng.standard_normal((heads, d, d))
    W_k = rng.standard_normal((heads, d, d))
    cfg = LayerConfig(d_model=d, n_heads=heads, d_head=d, norm="l2")
    return make_layers(W_v[None], W_o[None], W_q=W_q[None], W_k=W_k[None],
                       scale=1.0 if scale is None else scale, config=cfg)


@pytest.mark.parametrize("lam,flips", [(3.9, None), (4.1, "minority"), (-3.9, None), (-4.1, "majority")])
def test_bipartite_uniform_threshold(lam, flips):
    """Tokens s_i v (F v = lam v), n = 8 with n+ = 5, n- = 3, uniform attention: xbar = m v,
    m = (n+ - n-)/n = 1/4, so x_i + F xbar = (s_i + lam m) v and the token becomes
    sign(s_i + lam m) v. Fixed iff 1 + lam s_i m > 0 for all i, i.e. |lam| < n/|n+ - n-| = 4.
    lam = 4.1 flips the minority (-1 + 1.025 > 0), lam = -4.1 the majority. With 3 heads
    the result is the same: every head shares A, so the sum is F xbar."""
    F, Q = _sym([lam, 0.7, -0.3, 0.2], seed=14)
    v = Q[:, 0]
    s = np.array([1, 1, 1, 1, 1, -1, -1, -1], float)
    X = s[:, None] * v[None]
    expect_sign = np.sign(s + lam * 0.25)
    assert (flips is None) == np.all(expect_sign == s)
    for heads in (1, 3):
        lp = _bip_layers(F, heads, 15).layer(0)
        Y = np.asarray(layer_step(lp, jnp.asarray(X), jnp.ones(8, bool), rule="paper", attention="uniform"))
        np.testing.assert_allclose(Y, expect_sign[:, None] * v[None], atol=1e-12)


def test_bipartite_softmax_one_head_fixed_point_condition():
    """One softmax head, no biases, tokens s_i v: q_i = s_i W_q v, k_j = s_j W_k v, so the
    score is s_i s_j c with c = scale (W_q v).(W_k v). A query of group s weights its own
    group by e^c and the other by e^-c, so (A X)_i = m_{s_i} v with
        m_+ = (n+ e^c - n- e^-c) / (n+ e^c + n- e^-c),
        m_- = (n+ e^-c - n- e^c) / (n+ e^-c + n- e^c),
    and (one head: O V = F) x_i + attn_i = (s_i + lam m_{s_i}) v. The configuration stays
    on the line of v (exactly bipartite) and is a fixed point iff 1 + lam s m_s > 0 for
    both groups: group + flips past lam = -1/m_+, group - past lam = 1/m_-. We set c = 0.8
    and check both sides of both thresholds."""
    n_plus, n_minus, c = 4, 2, 0.8
    s = np.array([1] * n_plus + [-1] * n_minus, float)
    ep, em = math.exp(c), math.exp(-c)
    m_p = (n_plus * ep - n_minus * em) / (n_plus * ep + n_minus * em)
    m_m = (n_plus * em - n_minus * ep) / (n_plus * em + n_minus * ep)
    assert m_p > 0 and m_m < 0
    for lam in (-1 / m_p * 0.95, -1 / m_p * 1.05, 1 / m_m * 0.95, 1 / m_m * 1.05, 1.0 / abs(m_m) * 1.5):
        F, Q = _sym([lam, 0.7, -0.3, 0.2], seed=16)
        v = Q[:, 0]
        layers = _bip_layers(F, 1, 17)
        raw = float((layers.W_q[0, 0] @ v) @ (layers.W_k[0, 0] @ v))
        layers = layers.replace(scale=jnp.asarray([c / raw]))
        X = s[:, None] * v[None]
        Y = np.asarray(layer_step(layers.layer(0), jnp.asarray(X), jnp.ones(6, bool), rule="paper",
                                  attention="softmax"))
        m = np.where(s > 0, m_p, m_m)
        expect = np.sign(s + lam * m)[:, None] * v[None]
        np.testing.assert_allclose(Y, expect, atol=1e-12)
        fixed = np.all(1 + lam * s * m > 0)
        assert fixed == np.allclose(Y, X, atol=1e-12)


def test_bipartite_softmax_several_heads_not_fixed():
    """Three softmax heads, balanced n+ = n- = 3: head h gives (A_h X)_i = s_i tanh(c_h) v
    (c_h its own score constant), so x_i + attn_i = s_i (v + sum_h tanh(c_h) O_h V_h v). Only
    the sum F v = lam v is parallel to v; with unequal c_h the residual leaves the line of v,
    so the bipartite configuration is not a fixed point. Checked against that formula."""
    lam = 1.5
    F, Q = _sym([lam, 0.7, -0.3, 0.2], seed=18)
    v = Q[:, 0]
    layers = _bip_layers(F, 3, 19, scale=0.3)
    lp = layers.layer(0)
    s = np.array([1, 1, 1, -1, -1, -1], float)
    X = s[:, None] * v[None]
    Y = np.asarray(layer_step(lp, jnp.asarray(X), jnp.ones(6, bool), rule="paper", attention="softmax"))
    W_o, W_v = np.asarray(lp.W_o), np.asarray(lp.W_v)
    y = v.copy()
    cs = []
    for h in range(3):
        ch = 0.3 * float((np.asarray(lp.W_q[h]) @ v) @ (np.asarray(lp.W_k[h]) @ v))
        cs.append(ch)
        y += math.tanh(ch) * (W_o[:, 4 * h:4 * h + 4] @ (W_v[h] @ v))
    y /= np.linalg.norm(y)
    np.testing.assert_allclose(Y, s[:, None] * y[None], atol=1e-12)
    assert np.ptp(np.tanh(cs)) > 0.05
    assert abs(y @ v) < 1 - 1e-3                      # off the line of v: not a fixed point


# -------------------------------------------------------------------------------- measures

def test_chance_gamma():
    """E|cos| of a random unit vector with a fixed axis in R^d is Gamma(d/2)/(sqrt(pi) Gamma((d+1)/2));
    for a plane, E||P x|| = (sqrt(pi)/2) Gamma(d/2)/Gamma((d+1)/2) = pi/2 times that. Monte Carlo
    with 200k samples agrees to 4 standard errors. d = 2 gives 2/pi exactly."""
    for d in (2, 3, 10, 64, 384):
        exact = special.gamma(d / 2) / (math.sqrt(math.pi) * special.gamma((d + 1) / 2)) if d < 300 else \
            math.exp(special.gammaln(d / 2) - special.gammaln((d + 1) / 2)) / math.sqrt(math.pi)
        assert abs(M.chance_gamma(d, 1) - exact) < 1e-12 * exact
        if d > 2:
            assert abs(M.chance_gamma(d, 2) - math.pi / 2 * exact) < 1e-12 * exact
    assert abs(M.chance_gamma(2, 1) - 2 / math.pi) < 1e-14
    assert M.chance_gamma(5, 5) == 1.0
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200_000, 10))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    for k in (1, 2):
        samples = np.linalg.norm(x[:, :k], axis=1)
        se = samples.std() / math.sqrt(len(samples))
        assert abs(samples.mean() - M.chance_gamma(10, k)) < 4 * se
        assert abs(samples.std() - M.chance_gamma_std(10, k)) < 0.01 * samples.std()
    assert abs(M.chance_gamma(1000, 1) - math.sqrt(2 / (math.pi * 1000))) < 1e-3 * M.chance_gamma(1000, 1)


def test_binomial_pvalue():
    """P(Bin(N, p) >= k) = sum_{j >= k} C(N, j) p^j (1-p)^(N-j), exact sum and scipy."""
    for k, N, p in [(7, 10, 0.5), (0, 5, 0.5), (10, 10, 0.5), (60, 100, 0.5), (3, 20, 0.1)]:
        exact = sum(math.comb(N, j) * p ** j * (1 - p) ** (N - j) for j in range(k, N + 1))
        assert abs(M.binomial_pvalue(k, N, p) - exact) < 1e-12
        assert abs(M.binomial_pvalue(k, N, p) - stats.binomtest(k, N, p, alternative="greater").pvalue) < 1e-12
    assert abs(M.binomial_pvalue(7, 10) - 176 / 1024) < 1e-15


def test_state_measures_by_hand():
    """X = [[1, 0], [0, 1]] plus a padding row: xbar = (1/2, 1/2), X - xbar = +-(1/2, -1/2),
    mu = 1/sqrt(2); residual column sums (1, 1) and row sums (1, 1) over X's (1, 1) and
    (1, 1): res = 1; cos = 0.
    X = [[3, 4], [3, 4], [0, 5]]: xbar = (2, 13/3), R = [[1, -1/3], [1, -1/3], [-2, 2/3]],
    ||R||_F^2 = 20/3, ||X||_F^2 = 75 -> mu = sqrt(4/45); ||R||_1 = max(4, 4/3) = 4,
    ||R||_inf = max(4/3, 4/3, 8/3) = 8/3, ||X||_1 = max(6, 13) = 13, ||X||_inf = 7,
    res = sqrt(32/3 / 91); cosines: (1, .8, .8) over ordered pairs -> (2*1 + 4*.8)/6 = 13/15."""
    X = jnp.array([[1.0, 0.0], [0.0, 1.0], [7.0, -3.0]])
    valid = jnp.array([True, True, False])
    assert abs(float(DM.consensus_distance(X, valid)) - 1 / math.sqrt(2)) < 1e-14
    assert abs(float(DM.rank_collapse_residual(X, valid)) - 1.0) < 1e-14
    assert abs(float(DM.mean_pairwise_cosine(X, valid))) < 1e-14
    X = jnp.array([[3.0, 4.0], [3.0, 4.0], [0.0, 5.0]])
    ok = jnp.ones(3, bool)
    assert abs(float(DM.consensus_distance(X, ok)) - math.sqrt(4 / 45)) < 1e-14
    assert abs(float(DM.rank_collapse_residual(X, ok)) - math.sqrt(32 / 3 / 91)) < 1e-14
    assert abs(float(DM.mean_pairwise_cosine(X, ok)) - 13 / 15) < 1e-14
    # gamma against a zero-padded basis: only the first k columns count
    B = jnp.array([[1.0, 0.0], [0.0, 0.0]])
    np.testing.assert_allclose(np.asarray(DM.token_alignment(X, B)), [0.6, 0.6, 0.0], atol=1e-15)


def test_pooled_weights_by_valid_tokens():
    """pooled(): gamma and rho are means over all valid tokens of all prompts, i.e. prompt
    means weighted by n_valid (here 3 and 5 valid tokens), rho_count = rho * 8 exactly;
    consensus etc. are plain prompt means. Checked against per-prompt runs."""
    F, _ = _sym([2.0, 0.5, -0.3, 0.1], seed=20)
    layers = synthetic_system(None, F=F, heads=2, seed=1, steps=4, dtype=np.float64)
    sub = reference_subspaces(layer_spectra(F), dtype=jnp.float64)
    rng = np.random.default_rng(21)
    X0 = rng.standard_normal((2, 5, 4))
    valid = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    traj = simulate_batch(layers, X0, sub, valid=valid, attention="softmax")
    P = pooled(traj)
    singles = [simulate_jit(layers, jnp.asarray(X0[b, valid[b]]), sub, attention="softmax") for b in range(2)]
    g = (3 * np.asarray(singles[0].gamma) + 5 * np.asarray(singles[1].gamma)) / 8
    np.testing.assert_allclose(P["gamma"], g, atol=1e-12)
    r = (3 * np.asarray(singles[0].rho) + 5 * np.asarray(singles[1].rho)) / 8
    np.testing.assert_allclose(P["rho"][:, 0], r[:, 0], atol=1e-12)
    counts = 3 * np.asarray(singles[0].rho[:, 0]) + 5 * np.asarray(singles[1].rho[:, 0])
    np.testing.assert_array_equal(P["rho_count"][:, 0], np.rint(counts).astype(int))
    assert P["n_tokens"] == 8
    c = (np.asarray(singles[0].consensus) + np.asarray(singles[1].consensus)) / 2
    np.testing.assert_allclose(P["consensus"], c, atol=1e-12)
