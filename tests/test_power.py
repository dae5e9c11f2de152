"""At consensus the paper layer is one step of the power method on I + F, run through ``pl.run``.

With uniform attention every token gets F xbar added, so once the tokens agree (x_i = x)
the layer maps x to (I + F) x / ||(I + F) x||: block power iteration with one vector.
For a dominant complex pair lambda1, conj(lambda1) of F, that vector converges to the real
invariant plane span(Re v1, Im v1), its distance tan(angle(x, plane)) shrinking by
|1 + lambda3| / |1 + lambda1| per step, lambda3 the largest |1 + lambda| outside the pair:
exactly at every step when F is normal (the plane is orthogonal to the rest), as a
geometric mean when F is not (the iterate turns through a non-orthogonal basis). The real
ordering, rates and sign flips of the direction are in tests/test_dynamics_analytic.py.
"""
import jax.numpy as jnp
import numpy as np
import pytest

import powerlens as pl

pytestmark = pytest.mark.usefixtures("x64")   # float64 for this module only (tests/conftest.py)

LAMBDA = 0.4 + 1.5j          # |1 + lambda1| = |1.4 + 1.5j| = 2.05; next |1 + 0.5| = 1.5
REST = [0.5, -0.3, 0.2, 0.1]


def _plane_tans(F, steps, seed):
    """tan of the angle between each state's token and the shifted principal plane of F,
    for tokens started at consensus (all equal) and run under the paper rule."""
    d = F.shape[0]
    cfg = pl.LayerConfig(d_model=d, n_heads=1, d_head=d, norm="l2", schedule=pl.Schedule.repeat(0, steps))
    layers = pl.make_layers(jnp.asarray(F)[None, None], jnp.eye(d)[None], config=cfg)
    x = np.random.default_rng(seed).standard_normal(d)
    x0 = np.tile(x / np.linalg.norm(x), (3, 1))
    S = np.asarray(pl.run(layers, x0, None, rule="paper", attention="uniform",
                          observers={"states": pl.states()})["states"])
    sp = pl.layer_spectra(F)[0].shifted
    assert sp.dim == 2 and sp.is_complex
    P = sp.basis @ sp.basis.T
    tokens = S[:, 0]
    np.testing.assert_allclose(S, np.repeat(tokens[:, None], 3, axis=1), atol=1e-14)    # consensus stays
    return np.linalg.norm(tokens - tokens @ P, axis=1) / np.linalg.norm(tokens @ P, axis=1)


@pytest.mark.parametrize("kind", ["normal", "nonnormal"])
def test_consensus_converges_to_the_complex_pair_plane_at_the_power_rate(kind):
    F = pl.spectrum_matrix([LAMBDA, *REST], kind=kind, d=6, seed=0, nonnormality=0.5)
    key = np.sort(np.abs(1 + np.linalg.eigvals(F)))[::-1]
    assert abs(key[0] - key[1]) < 1e-9 and key[1] > key[2] + 0.1          # the pair, then a gap
    predicted = 1.5 / abs(1 + LAMBDA)
    assert abs(key[2] / key[0] - predicted) < 1e-9
    tans = _plane_tans(F, 80, seed=5)[30:71]          # after the 1.2^t / 1.5^t transient of the rest
    rate = float(np.exp(np.polyfit(np.arange(tans.size), np.log(tans), 1)[0]))
    np.testing.assert_allclose(rate, predicted, rtol=1e-2)
    per_step = tans[1:] / tans[:-1]
    if kind == "normal":
        np.testing.assert_allclose(per_step, predicted, rtol=5e-3)
    else:
        assert per_step.max() > predicted * 1.05 and per_step.min() < predicted / 1.05
        assert np.all(per_step < 1)
