"""Hypothesis properties of the dynamics, the measures and the synthetic systems.

Shapes are fixed (n = 5 tokens, d = 6, 2 heads of size 3) so one jitted function per
(rule, attention) serves every example. Expected values come from the NumPy oracle
(tests/reference_numpy.py) or from formulas written out here, never from powerlens itself.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy import stats

import reference_numpy as R

from powerlens._src.analysis.measures import random_subspace
from powerlens._src.analysis.spectra import layer_spectra, reference_subspaces
from powerlens._src.dynamics.layer import layer_step
from powerlens._src.dynamics.measures import token_alignment as alignment
from powerlens._src.dynamics.params import LayerConfig, layer_matrices, make_layers
from powerlens._src.dynamics.synthetic import spectrum_matrix, synthetic_system

N, D, H, E = 5, 6, 2, 3
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
floats = st.floats(-2.0, 2.0, allow_nan=False, allow_infinity=False, width=32)
tokens = hnp.arrays(np.float32, (N, D), elements=floats)
# every entry of magnitude in [1/8, 2]: every token has norm >= sqrt(D) / 8, so none is zero
# and N2 is defined on the inputs (no example is thrown away)
nonzero = st.one_of(st.floats(-2.0, -0.125, width=32), st.floats(0.125, 2.0, width=32))
nonzero_tokens = hnp.arrays(np.float32, (N, D), elements=nonzero)


def _layers(seed, norm="layernorm", scale=0.5):
    rng = np.random.default_rng(seed)
    f = lambda *s: (0.5 * rng.standard_normal(s)).astype(np.float32)
    cfg = LayerConfig(d_model=D, n_heads=H, d_head=E, norm=norm)
    return make_layers(f(1, H, E, D), f(1, D, H * E), W_q=f(1, H, E, D), W_k=f(1, H, E, D), scale=scale,
                       b_q=f(1, H, E), b_k=f(1, H, E), b_v=f(1, H, E), b_o=f(1, D),
                       norm_scale=1 + f(1, D), norm_bias=f(1, D), config=cfg)


@functools.lru_cache(maxsize=None)
def _step(rule, attention):
    return jax.jit(lambda lp, X, valid: layer_step(lp, X, valid, rule=rule, attention=attention))


@pytest.mark.parametrize("attention", ["softmax", "uniform", "identity"])
@SETTINGS
@given(X=nonzero_tokens, seed=st.integers(0, 2 ** 16))
def test_unit_rows_after_n2(attention, X, seed):
    """rule paper ends with N2: the output is finite (a NaN fails), every row has unit L2 norm,
    and it is the oracle's (x_i + attn_i) / ||x_i + attn_i|| in float64 to float32 rounding."""
    layers = _layers(seed)
    Y = np.asarray(_step("paper", attention)(layers.layer(0), jnp.asarray(X), jnp.ones(N, bool)))
    assert np.all(np.isfinite(Y)), Y
    np.testing.assert_allclose(np.linalg.norm(Y, axis=1), 1.0, atol=2e-6)
    X64 = X.astype(np.float64)
    attn = R.attention_out(R.layer_dicts(layers)[0], X64, np.ones(N, bool), mode=attention, causal=False)
    Z = X64 + attn
    # float32 rounding: 1e-6 of the summands (~10x the error seen over 900 random cases),
    # divided by the norm N2 divides by
    tol = 1e-6 * (1 + np.linalg.norm(X64, axis=1) + np.linalg.norm(attn, axis=1)) / np.linalg.norm(Z, axis=1)
    err = np.abs(Y - Z / np.linalg.norm(Z, axis=1, keepdims=True)).max(axis=1)
    assert np.all(err < tol), (err, tol)


@pytest.mark.parametrize("rule", ["paper", "post_ln", "pre_ln"])
@pytest.mark.parametrize("attention", ["softmax", "uniform", "identity"])
@SETTINGS
@given(X=tokens, perm=st.permutations(range(N)), seed=st.integers(0, 2 ** 16))
def test_permutation_equivariance(rule, attention, X, perm, seed):
    """Without a causal mask or window, f(P X) = P f(X) for every token permutation P."""
    assume(np.all(np.linalg.norm(X, axis=1) > 0.1))
    lp = _layers(seed).layer(0)
    f = _step(rule, attention)
    perm = np.asarray(perm)
    Y = np.asarray(f(lp, jnp.asarray(X), jnp.ones(N, bool)))
    Yp = np.asarray(f(lp, jnp.asarray(X[perm]), jnp.ones(N, bool)))
    scale = 1 + np.abs(Y).max()
    np.testing.assert_allclose(Yp, Y[perm], atol=2e-5 * scale)


def _gamma(X, P):
    """gamma_i = ||P x_i|| / ||x_i|| for the orthogonal projector P, in float64."""
    X = np.asarray(X, np.float64)
    return np.linalg.norm(X @ P, axis=1) / np.linalg.norm(X, axis=1)


@SETTINGS
@given(X=nonzero_tokens, seed=st.integers(0, 2 ** 16), phi=st.floats(0.0, 2 * np.pi))
def test_gamma_invariant_to_eigenvector_phase(X, seed, phi):
    """gamma depends on the subspace only. spectra's principal basis of a dominant complex
    pair lam is orthonormal, F-invariant and carries lam, conj(lam); gamma against it is
    ||P x|| / ||x|| with P the projector onto span(Re z, Im z) of the eigenvector z taken with
    any phase e^{i phi} (P = Z pinv(Z), no QR); and gamma is unchanged by B -> -B. For a
    real dominant eigenvalue: F v = lam v, and v, -v give bit-identical gamma."""
    lam = 1.5 + 1.0j                       # |1 + lam| = 2.69 > 1.3, 1.1, 1.05, 0.8
    F = spectrum_matrix([lam, 0.3, -0.2, 0.1, 0.05], kind="nonnormal", d=D, seed=seed, nonnormality=0.5)
    sp = layer_spectra(F)[0].shifted
    sb = sp.basis
    assert sp.dim == 2 and sp.is_complex and abs(sp.top - lam) < 1e-8
    np.testing.assert_allclose(sb.T @ sb, np.eye(2), atol=1e-10)
    T2 = sb.T @ F @ sb
    np.testing.assert_allclose(F @ sb, sb @ T2, atol=1e-8 * np.abs(F).max())
    np.testing.assert_allclose(np.sort_complex(np.linalg.eigvals(T2)), [np.conj(lam), lam], atol=1e-8)
    w, V = np.linalg.eig(F)
    z = V[:, int(np.argmin(np.abs(w - lam)))] * np.exp(1j * phi)
    Z = np.stack([z.real, z.imag], axis=1)
    want = _gamma(X, Z @ np.linalg.pinv(Z))
    Xj = jnp.asarray(X, jnp.float32)
    g = np.asarray(alignment(Xj, jnp.asarray(sb, jnp.float32)))
    np.testing.assert_allclose(g, want, atol=1e-5)
    np.testing.assert_allclose(np.asarray(alignment(Xj, jnp.asarray(-sb, jnp.float32))), g, atol=1e-6)
    # a real eigenvector and its negative
    Fr = spectrum_matrix([2.0, 0.5, -0.3], kind="nonnormal", d=D, seed=seed + 1)
    v = layer_spectra(Fr)[0].shifted.basis
    assert v.shape == (D, 1)
    np.testing.assert_allclose(Fr @ v, 2.0 * v, atol=1e-8 * np.abs(Fr).max())
    gv = np.asarray(alignment(Xj, jnp.asarray(v, jnp.float32)))
    np.testing.assert_allclose(gv, np.abs(np.asarray(X, np.float64) @ v[:, 0]) / np.linalg.norm(X, axis=1),
                               atol=1e-5)
    np.testing.assert_array_equal(gv, np.asarray(alignment(Xj, jnp.asarray(-v, jnp.float32))))


@SETTINGS
@given(seed=st.integers(0, 2 ** 16), pairs=st.lists(st.booleans(), min_size=1, max_size=3))
def test_random_control_is_orthonormal_and_matches_principal_dim(seed, pairs):
    """reference_subspaces' random control of each layer (reference 1) is an orthonormal
    basis of the principal subspace's dimension (1 for a real top eigenvalue, 2 for a
    complex pair), zero-padded beyond it; the same seed gives the same control."""
    Fs = [spectrum_matrix([1.5 + 0.7j if pair else 2.0, 0.3, -0.2], kind="normal", d=D, seed=seed + i)
          for i, pair in enumerate(pairs)]
    spectra = layer_spectra(np.stack(Fs))
    sub = reference_subspaces(spectra, seed=seed)
    basis, dim = np.asarray(sub.basis, np.float64), np.asarray(sub.dim)
    for u, pair in enumerate(pairs):
        k = 2 if pair else 1
        assert dim[u, 0] == dim[u, 1] == k
        B = basis[u, 1]
        np.testing.assert_allclose(B[:, :k].T @ B[:, :k], np.eye(k), atol=1e-6)
        np.testing.assert_array_equal(B[:, k:], 0.0)
    np.testing.assert_array_equal(np.asarray(reference_subspaces(spectra, seed=seed).basis), sub.basis)


def test_random_subspace_is_uniform():
    """random_subspace(rng, d=6, k=2), the random control, is uniformly (Haar) distributed,
    checked three ways on 4,000 draws: (1) for a fixed unit x, ||Q^T x||^2 ~ Beta(k/2, (d-k)/2)
    (Kolmogorov-Smirnov); (2) the mean projector is (k/d) I; (3) the first basis column is
    uniform on the sphere, so its mean is 0 (a QR without the sign fix of R's diagonal fails
    this: its first column always points to the same half-space)."""
    d, k, n = 6, 2, 4000
    rng = np.random.default_rng(123)
    Qs = np.stack([random_subspace(rng, d, k) for _ in range(n)])          # (n, d, k)
    np.testing.assert_allclose(np.einsum("ndi,ndj->nij", Qs, Qs), np.broadcast_to(np.eye(k), (n, k, k)),
                               atol=1e-12)
    x = np.ones(d) / np.sqrt(d)
    g2 = np.sum(np.einsum("d,ndk->nk", x, Qs) ** 2, axis=1)
    assert stats.kstest(g2, stats.beta(k / 2, (d - k) / 2).cdf).pvalue > 1e-3
    # 5 sigma: Var P_ii = Var Beta(1, 2) = 1/18, off-diagonal smaller; Var q_1i = 1/d
    np.testing.assert_allclose(np.einsum("ndk,nek->de", Qs, Qs) / n, (k / d) * np.eye(d),
                               atol=5 * np.sqrt(1 / 18 / n))
    np.testing.assert_allclose(Qs[:, :, 0].mean(0), 0.0, atol=5 * np.sqrt(1 / d / n))


@SETTINGS
@given(seed=st.integers(0, 2 ** 16), heads_extra=st.sampled_from([(2, 0), (3, 1)]), group=st.sampled_from([1, 2]))
def test_layer_matrices_of_split_heads(seed, heads_extra, group):
    """The synthetic builder's head split of a given F gives W_v, W_o with W_o concat_h(W_vh) = F
    (H e >= d); layer_matrices rebuilds F, also with grouped-query attention (each kv head's
    output block split over `group` query heads). Two head shapes (H e = d and H e > d), one
    compiled builder each."""
    heads, extra = heads_extra
    F = np.random.default_rng(seed).standard_normal((D, D))
    e = -(-D // heads) + extra
    with jax.enable_x64(True):
        split = synthetic_system(None, F=F, heads=heads, d_head=e, seed=seed, dtype=np.float64)
    V, O = np.asarray(split.W_v[0]), np.asarray(split.W_o[0])
    np.testing.assert_allclose(O @ V.reshape(heads * e, D), F, atol=1e-10)
    Oq = np.concatenate([O[:, g * e:(g + 1) * e] / group for g in range(heads) for _ in range(group)], axis=1)
    cfg = LayerConfig(d_model=D, n_heads=heads * group, n_kv_heads=heads, d_head=e, norm="l2")
    layers = make_layers(V[None].astype(np.float32), Oq[None].astype(np.float32), config=cfg)
    got = np.asarray(layer_matrices(layers))[0]
    np.testing.assert_allclose(got, F, atol=2e-4 * (1 + np.abs(F).max()))


eig_real = st.floats(-3.0, 3.0, allow_nan=False).map(lambda x: round(x, 3))
eig_cplx = st.tuples(st.floats(-3.0, 3.0), st.floats(0.2, 2.0)).map(lambda t: complex(round(t[0], 3), round(t[1], 3)))


@SETTINGS
@given(kind=st.sampled_from(["symmetric", "normal", "nonnormal"]), real=st.lists(eig_real, min_size=1, max_size=4),
       cplx=st.lists(eig_cplx, max_size=2), seed=st.integers(0, 2 ** 16))
def test_spectrum_matrix_eigenvalues(kind, real, cplx, seed):
    """spectrum_matrix has exactly the requested eigenvalues (complex entries as conjugate
    pairs, zeros filling up to d = 8: one compiled builder per kind); symmetric -> F = F^T;
    normal -> F F^T = F^T F."""
    if kind == "symmetric":
        cplx = []
    eigs = real + cplx
    d = 8
    pad = d - len(real) - 2 * len(cplx)
    F = spectrum_matrix(eigs, kind=kind, d=d, seed=seed, nonnormality=0.5)
    want = np.array(real + [z for c in cplx for z in (c, np.conj(c))] + [0.0] * pad, complex)
    got = np.linalg.eigvals(F)
    # match each requested eigenvalue greedily to its nearest computed one
    tol = 1e-8 if kind != "nonnormal" else 1e-6
    used = np.zeros(len(got), bool)
    for z in sorted(want, key=lambda z: (z.real, z.imag)):
        dist = np.where(used, np.inf, np.abs(got - z))
        j = int(np.argmin(dist))
        assert dist[j] < tol * (1 + abs(z)) or (np.sum(np.abs(want - z) < 1e-9) > 1 and dist[j] < 1e-4), (z, got)
        used[j] = True
    if kind == "symmetric":
        np.testing.assert_allclose(F, F.T, atol=1e-12)
    if kind == "normal":
        np.testing.assert_allclose(F @ F.T, F.T @ F, atol=1e-10)


# mean_angle: the angles of one branch of the circle, whichever side of +-pi each was wrapped to
angles = hnp.arrays(np.float64, st.integers(1, 12), elements=st.floats(-1.4, 1.4))


def _wrapped_diff(a, b):
    return np.abs((np.asarray(a) - np.asarray(b) + np.pi) % (2 * np.pi) - np.pi)


@SETTINGS
@given(dev=angles, center=st.floats(-np.pi, np.pi), turns=st.lists(st.integers(-3, 3), min_size=12, max_size=12))
def test_mean_angle_is_the_mean_on_one_branch(dev, center, turns):
    """Angles center + dev_i (|dev_i| < 1.4 < pi/2), each shifted by a whole number of turns:
    the mean is center + mean(dev), mod 2 pi, whatever the center (near +-pi too) and the
    turns; the plain mean of the wrapped angles is not, once the angles straddle +-pi."""
    from powerlens._src.dynamics.measures import mean_angle
    a = center + dev + 2 * np.pi * np.asarray(turns[:dev.size])
    valid = np.ones(dev.size, bool)
    assert _wrapped_diff(mean_angle(a, valid), center + dev.mean()) < 1e-12
    # the same angles read on [-pi, pi) as JAX float32, padded with garbage that is masked out
    a32 = jnp.asarray(np.concatenate([a, [1.0, -2.0]]), jnp.float32)
    got = mean_angle(a32, jnp.asarray(np.concatenate([valid, [False, False]])))
    assert got.dtype == jnp.float32 and -np.pi <= float(got) < np.pi
    assert _wrapped_diff(float(got), center + dev.mean()) < 1e-5


def test_mean_angle_straddling_pi():
    """Steps of pi - 0.1, pi + 0.1, pi - 0.2 and pi + 0.3 (the last three wrapped to -pi + 0.1,
    pi - 0.2, -pi + 0.3): their mean is pi + 0.025, i.e. -pi + 0.025; the plain mean of the
    wrapped values is 0.025, on the opposite side of the circle."""
    from powerlens._src.dynamics.measures import mean_angle
    a = np.array([np.pi - 0.1, -np.pi + 0.1, np.pi - 0.2, -np.pi + 0.3])
    assert abs(a.mean() - 0.025) < 1e-12
    assert abs(mean_angle(a, np.ones(4, bool)) - (-np.pi + 0.025)) < 1e-12
    # rows are independent; a row with no valid entry gives the circular mean of nothing, 0
    two = mean_angle(np.stack([a, a + 1.0]), np.array([[True] * 4, [False] * 4]))
    np.testing.assert_allclose(two, [-np.pi + 0.025, 0.0], atol=1e-12)
