"""The power method as scans (powerlens.dynamics.power) against numpy eig, in float64.

Power iteration on A = F + shift I converges to the eigenvector of the eigenvalue of
largest |lambda + shift| with tan(angle) shrinking by |lambda2 + shift| / |lambda1 + shift|
per step (F symmetric, so the eigenvectors are orthogonal and the rate is exact
asymptotically). Subspace iteration with k = 2 converges to the dominant invariant
plane of a complex pair; its 2x2 restriction Q^T F Q has the pair as eigenvalues.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from powerlens.analysis.spectra import layer_spectra
from powerlens.dynamics import power as P
from powerlens.dynamics.synthetic import haar_orthogonal, spectrum_matrix


pytestmark = pytest.mark.usefixtures("x64")   # float64 for this module only (tests/conftest.py)


def _sym(eigs, seed):
    Q = haar_orthogonal(np.random.default_rng(seed), len(eigs))
    return Q @ np.diag(eigs) @ Q.T, Q


def _tans(H, v):
    c = H @ v
    return np.linalg.norm(H - c[:, None] * v[None], axis=1) / np.abs(c)


@pytest.mark.parametrize("shift,top,rate", [
    (0.0, 0, 2.5 / 3.0),     # plain: |3| > |-2.5| > |1|: rate 2.5/3
    (1.0, 0, 2.0 / 4.0),     # shifted: |1+3| = 4 > |1+1| = 2 > |1-2.5| = 1.5: rate 1/2
])
def test_power_iteration_rate(shift, top, rate):
    """F = Q diag(3, -2.5, 1, 0.5, -0.2) Q^T. The Rayleigh quotient converges to 3."""
    F, Q = _sym([3.0, -2.5, 1.0, 0.5, -0.2], seed=0)
    v0 = np.random.default_rng(1).standard_normal(5)
    v, hist = P.power_iteration(jnp.asarray(F), jnp.asarray(v0), 60, shift=shift)
    hist = np.asarray(hist)
    t = _tans(hist, Q[:, top])
    window = slice(15, 40) if shift == 0 else slice(10, 35)
    r = t[window][1:] / t[window][:-1]
    np.testing.assert_allclose(r, rate, rtol=1e-2)
    assert abs(float(P.rayleigh_quotient(jnp.asarray(F), v)) - 3.0) < 1e-8
    np.testing.assert_allclose(np.linalg.norm(hist, axis=1), 1.0, atol=1e-14)


def test_power_iteration_negative_dominant():
    """F with eigenvalues -3, 1.5, 0.5, 0.2: the plain method finds v(-3) and its iterate flips
    sign every step (A v = -3 v); the shifted one finds v(1.5) (|2.5| > |-2|) at rate 2/2.5."""
    F, Q = _sym([-3.0, 1.5, 0.5, 0.2], seed=2)
    v0 = jnp.asarray(np.random.default_rng(3).standard_normal(4))
    v, hist = P.power_iteration(jnp.asarray(F), v0, 200, shift=0.0)
    c = np.asarray(hist) @ Q[:, 0]
    assert abs(abs(c[-1]) - 1) < 1e-12
    assert np.all(np.sign(c[1:]) == -np.sign(c[:-1]))
    assert abs(float(P.rayleigh_quotient(jnp.asarray(F), v)) + 3.0) < 1e-10
    v, hist = P.power_iteration(jnp.asarray(F), v0, 200, shift=1.0)
    assert abs(abs(float(v @ Q[:, 1])) - 1) < 1e-12
    t = _tans(np.asarray(hist), Q[:, 1])
    np.testing.assert_allclose(t[41:80] / t[40:79], 0.8, rtol=1e-2)


@pytest.mark.parametrize("kind", ["normal", "nonnormal"])
def test_subspace_iteration_complex_pair(kind):
    """Dominant pair 0.4 +- 1.5j (|1+l| = 2.13 vs <= 1.5 for 0.5, -0.3, 0.2, 0.1): the 2-D basis
    spans the same plane as spectra's Schur basis (equal projectors) and the 2x2 restriction
    gives back the pair, larger imaginary part first."""
    lam = 0.4 + 1.5j
    F = spectrum_matrix([lam, 0.5, -0.3, 0.2, 0.1], kind=kind, d=6, rng=np.random.default_rng(4),
                        nonnormality=0.5)
    sp = layer_spectra(F)[0].shifted
    assert sp.dim == 2 and sp.is_complex
    Q0 = jnp.asarray(np.random.default_rng(5).standard_normal((6, 2)))
    Q = np.asarray(P.subspace_iteration(jnp.asarray(F), Q0, 300, shift=1.0))
    np.testing.assert_allclose(Q.T @ Q, np.eye(2), atol=1e-12)
    np.testing.assert_allclose(Q @ Q.T, sp.basis @ sp.basis.T, atol=1e-9)
    ev = np.asarray(P.top_pair_eigenvalues(jnp.asarray(F), jnp.asarray(Q)))
    np.testing.assert_allclose(ev, [lam, np.conj(lam)], atol=1e-9)
    Qd, evd = P.dominant_plane(jnp.asarray(F), jax.random.PRNGKey(0), 300)
    np.testing.assert_allclose(np.asarray(Qd) @ np.asarray(Qd).T, sp.basis @ sp.basis.T, atol=1e-9)
    np.testing.assert_allclose(np.asarray(evd), [lam, np.conj(lam)], atol=1e-9)
    # the block iteration's convergence rate toward the plane: |1 + l3| / |1 + l1|, l3 the
    # largest |1 + l| outside the pair, read off numpy's eigenvalues of F: 1.5 / |1.4 + 1.5j|
    key = np.sort(np.abs(1 + np.linalg.eigvals(F)))[::-1]
    assert abs(key[0] - key[1]) < 1e-9 and key[1] > key[2] + 0.1          # the pair, then a gap
    predicted = key[2] / key[0]
    assert abs(predicted - 1.5 / abs(1 + lam)) < 1e-9
    # the error (sin of the largest principal angle) after every step 10..70, one step at a time
    one_step = jax.jit(lambda Q: P.subspace_iteration(jnp.asarray(F), Q, 1, shift=1.0))
    Qs, errs = P.subspace_iteration(jnp.asarray(F), Q0, 10, shift=1.0), []
    for _ in range(61):
        errs.append(np.linalg.norm(np.asarray(Qs) @ np.asarray(Qs).T - sp.basis @ sp.basis.T, 2))
        Qs = one_step(Qs)
    errs = np.array(errs)
    per_step = errs[1:] / errs[:-1]
    # the geometric mean rate (least-squares slope of log err) is the prediction for both kinds
    rate = float(np.exp(np.polyfit(np.arange(61), np.log(errs), 1)[0]))
    np.testing.assert_allclose(rate, predicted, rtol=1e-2)
    if kind == "normal":
        # F normal: the pair's plane is orthogonal to the rest, the decay is geometric at every step
        np.testing.assert_allclose(per_step, predicted, rtol=5e-3)
    else:
        # F non-normal: within the pair's plane the iterate turns by arg(1 + l) through a
        # non-orthogonal basis, so the per-step ratio oscillates about the rate (not monotone)
        assert per_step.max() > predicted * 1.05 and per_step.min() < predicted / 1.05
        assert np.all(per_step < 1)


def test_top_pair_float32():
    """float32 input gives complex64 eigenvalues of the same pair (to float32 rounding)."""
    lam = 0.4 + 1.5j
    F = spectrum_matrix([lam, 0.5, -0.3], kind="normal", d=4, rng=np.random.default_rng(6)).astype(np.float32)
    Qd, ev = P.dominant_plane(jnp.asarray(F), jax.random.PRNGKey(1), 200)
    assert ev.dtype == jnp.complex64
    np.testing.assert_allclose(np.asarray(ev), [lam, np.conj(lam)], atol=1e-4)


def test_real_pair_block_iteration():
    """Block iteration with k = 2 on a real spectrum (3, 2, 0.5, ...) spans span(v1, v2), and the
    restriction's eigenvalues are 3 and 2 (real)."""
    F, Q = _sym([3.0, 2.0, 0.5, -0.4, 0.1], seed=7)
    Q0 = jnp.asarray(np.random.default_rng(8).standard_normal((5, 2)))
    B = np.asarray(P.subspace_iteration(jnp.asarray(F), Q0, 200, shift=1.0))
    np.testing.assert_allclose(B @ B.T, Q[:, :2] @ Q[:, :2].T, atol=1e-10)
    ev = np.sort(np.asarray(P.top_pair_eigenvalues(jnp.asarray(F), jnp.asarray(B))).real)
    np.testing.assert_allclose(ev, [2.0, 3.0], atol=1e-10)
    assert math.isclose(float(np.abs(np.asarray(P.top_pair_eigenvalues(jnp.asarray(F), jnp.asarray(B))).imag).max()),
                        0.0, abs_tol=1e-12)
