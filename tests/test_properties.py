"""Hypothesis properties of the dynamics, the measures and the synthetic systems.

Shapes are fixed (n = 5 tokens, d = 6, 2 heads of size 3) so one jitted function per
(rule, attention) serves every example.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from powerlens.analysis import measures as M
from powerlens.analysis.spectra import layer_spectra
from powerlens.dynamics.layer import layer_step
from powerlens.dynamics.params import LayerConfig, layer_matrices, make_layers
from powerlens.dynamics.synthetic import split_heads, spectrum_matrix

N, D, H, E = 5, 6, 2, 3
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
floats = st.floats(-2.0, 2.0, allow_nan=False, allow_infinity=False, width=32)
tokens = hnp.arrays(np.float32, (N, D), elements=floats)


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
@given(X=tokens, seed=st.integers(0, 2 ** 16))
def test_unit_rows_after_n2(attention, X, seed):
    """rule paper ends with N2: every output row has unit L2 norm."""
    assume(np.all(np.linalg.norm(X, axis=1) > 1e-2))
    lp = _layers(seed).layer(0)
    Y = np.asarray(_step("paper", attention)(lp, jnp.asarray(X), jnp.ones(N, bool)))
    assume(np.all(np.isfinite(Y)))
    np.testing.assert_allclose(np.linalg.norm(Y, axis=1), 1.0, atol=2e-6)


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


@SETTINGS
@given(X=tokens, seed=st.integers(0, 2 ** 16), phi=st.floats(0.0, 2 * np.pi))
def test_gamma_invariant_to_eigenvector_phase(X, seed, phi):
    """gamma depends on the subspace only: a real eigenvector and its negative give the same
    gamma; a complex eigenvector w and e^{i phi} w give the same real plane
    span(Re, Im) (equal projectors) and the same gamma as spectra's basis."""
    assume(np.all(np.linalg.norm(X, axis=1) > 1e-2))
    rng = np.random.default_rng(seed)
    F = spectrum_matrix([1.5 + 1.0j, 0.3, -0.2, 0.1, 0.05], kind="nonnormal", d=D, rng=rng, nonnormality=0.5)
    w, V = np.linalg.eig(F)
    i = int(np.argmax(np.abs(1 + w)))
    z = V[:, i] * np.exp(1j * phi)
    B, _ = np.linalg.qr(np.stack([z.real, z.imag], axis=1))
    B0, _ = np.linalg.qr(np.stack([V[:, i].real, V[:, i].imag], axis=1))
    np.testing.assert_allclose(B @ B.T, B0 @ B0.T, atol=1e-8)
    sb = layer_spectra(F)[0].shifted.basis
    Xj = jnp.asarray(X, jnp.float32)
    g = np.asarray(M.alignment(Xj, jnp.asarray(B, jnp.float32)))
    np.testing.assert_allclose(g, np.asarray(M.alignment(Xj, jnp.asarray(sb, jnp.float32))), atol=1e-5)
    np.testing.assert_allclose(g, np.asarray(M.alignment(Xj, jnp.asarray(-B, jnp.float32))), atol=1e-6)
    # a real eigenvector and its negative
    v = layer_spectra(spectrum_matrix([2.0, 0.5, -0.3], kind="nonnormal", d=D, rng=rng))[0].shifted.basis
    np.testing.assert_array_equal(np.asarray(M.alignment(Xj, jnp.asarray(v, jnp.float32))),
                                  np.asarray(M.alignment(Xj, jnp.asarray(-v, jnp.float32))))


@SETTINGS
@given(seed=st.integers(0, 2 ** 16), heads=st.integers(1, 4), extra=st.integers(0, 2),
       group=st.sampled_from([1, 2]))
def test_layer_matrices_of_split_heads(seed, heads, extra, group):
    """split_heads gives W_v, W_o with W_o concat_h(W_vh) = F; layer_matrices rebuilds F,
    also with grouped-query attention (each kv head's output block split over `group`
    query heads)."""
    rng = np.random.default_rng(seed)
    F = rng.standard_normal((D, D))
    e = -(-D // heads) + extra
    V, O = split_heads(F, heads, rng, d_head=e)
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
       cplx=st.lists(eig_cplx, max_size=2), pad=st.integers(0, 2), seed=st.integers(0, 2 ** 16))
def test_spectrum_matrix_eigenvalues(kind, real, cplx, pad, seed):
    """spectrum_matrix has exactly the requested eigenvalues (complex entries as conjugate
    pairs, zeros filling up to d); symmetric -> F = F^T; normal -> F F^T = F^T F."""
    if kind == "symmetric":
        cplx = []
    eigs = real + cplx
    d = len(real) + 2 * len(cplx) + pad
    F = spectrum_matrix(eigs, kind=kind, d=d, rng=np.random.default_rng(seed), nonnormality=0.5)
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
