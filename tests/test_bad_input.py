"""Bad input to the dynamics and analysis APIs: each is a clear error that names the culprit.

(The npz weights-file format is tested with the CLI.)
"""
import numpy as np
import pytest

from powerlens._src.analysis import measures as M
from powerlens._src.analysis.spectra import check_order, layer_spectra, reference_subspaces
from powerlens._src.dynamics.attention import check_attention
from powerlens._src.dynamics.layer import check_rule, layer_step
from powerlens._src.dynamics.params import LayerConfig, check_steps, make_layers
from powerlens._src.dynamics.simulate import check_tokens, simulate_batch
from powerlens._src.dynamics.synthetic import parse_spectrum, spectrum_matrix, synthetic_system

U, H, E, D = 1, 2, 3, 6


def _ok(**over):
    rng = np.random.default_rng(0)
    a = dict(W_v=rng.standard_normal((U, H, E, D)), W_o=rng.standard_normal((U, D, H * E)),
             W_q=rng.standard_normal((U, H, E, D)), W_k=rng.standard_normal((U, H, E, D)))
    a.update(over)
    return a


@pytest.fixture(scope="module")
def system():
    layers = synthetic_system([2.0, 0.5, -0.3], d=D, heads=H, steps=3)
    from powerlens._src.dynamics.params import layer_matrices
    sub = reference_subspaces(layer_spectra(np.asarray(layer_matrices(layers))))
    return layers, sub


def test_make_layers_wrong_shapes():
    with pytest.raises(ValueError, match=r"W_o has shape \(1, 6, 5\), expected \(1, 6, 6\)"):
        make_layers(**_ok(W_o=np.zeros((U, D, 5))))
    with pytest.raises(ValueError, match=r"W_q must have shape \(L, H, d_head, d\), got \(2, 3, 6\)"):
        make_layers(**_ok(W_q=np.zeros((H, E, D))))
    with pytest.raises(ValueError, match=r"W_k has shape \(1, 2, 3, 5\)"):
        make_layers(**_ok(W_k=np.zeros((U, H, E, 5))))
    with pytest.raises(ValueError, match=r"W_v must have shape"):
        make_layers(**_ok(W_v=np.zeros((H, E, D))))
    with pytest.raises(ValueError, match=r"b_q has shape"):
        make_layers(**_ok(b_q=np.zeros((U, H + 1, E))))
    cfg = LayerConfig(d_model=D + 1, n_heads=H, d_head=E)
    with pytest.raises(ValueError, match=r"config says d_head=3, d=7"):
        make_layers(**_ok(), config=cfg)


def test_non_finite_weights():
    W = _ok()["W_v"].copy()
    W[0, 1, 2, 3] = np.nan
    with pytest.raises(ValueError, match=r"W_v contains non-finite"):
        make_layers(**_ok(W_v=W))
    W = _ok()["W_o"].copy()
    W[0, 0, 0] = np.inf
    with pytest.raises(ValueError, match=r"W_o contains non-finite"):
        make_layers(**_ok(W_o=W))
    with pytest.raises(ValueError, match=r"scale contains non-finite"):
        make_layers(**_ok(), scale=np.nan)
    with pytest.raises(ValueError, match=r"F contains non-finite"):
        layer_spectra(np.full((2, 3, 3), np.nan))


def test_tokens(system):
    layers, sub = system
    x = np.random.default_rng(1).standard_normal((4, D))
    with pytest.raises(ValueError, match=r"x0 has width 5 but the system has d=6"):
        simulate_batch(layers, x[:, :5], sub)
    bad = x.copy()
    bad[2, 1] = np.inf
    with pytest.raises(ValueError, match=r"x0 contains non-finite"):
        simulate_batch(layers, bad, sub)
    bad = x.copy()
    bad[2] = 0.0
    with pytest.raises(ValueError, match=r"x0 has a zero-norm token at index \[2\]"):
        simulate_batch(layers, bad, sub)
    bad = np.stack([x, x])
    bad[1, 3] = 0.0
    with pytest.raises(ValueError, match=r"zero-norm token at index \[1, 3\]"):
        check_tokens(bad, D)
    with pytest.raises(ValueError, match=r"x0 must have shape \(n, d\) or \(B, n, d\)"):
        simulate_batch(layers, x[0], sub)
    with pytest.raises(ValueError, match=r"x0 has no tokens"):
        simulate_batch(layers, x[:0], sub)
    with pytest.raises(ValueError, match=r"valid mask has shape \(1, 3\), expected \(1, 4\)"):
        simulate_batch(layers, x, sub, valid=np.ones((1, 3), bool))
    with pytest.raises(ValueError, match=r"no valid token"):
        simulate_batch(layers, x, sub, valid=np.zeros((1, 4), bool))


@pytest.mark.parametrize("steps", [0, -3, 2.5, True])
def test_steps(system, steps):
    layers, _ = system
    with pytest.raises(ValueError, match=r"steps must be a positive integer"):
        check_steps(steps)
    with pytest.raises(ValueError, match=r"steps must be a positive integer"):
        layers.shared(0, steps)


def test_empty_schedule_and_bad_layer(system):
    layers, _ = system
    with pytest.raises(ValueError, match=r"schedule must contain at least one step"):
        layers.with_schedule(())
    with pytest.raises(ValueError, match=r"schedule refers to layer\(s\) \[3\] but only 1 exist"):
        layers.with_schedule((0, 3))
    with pytest.raises(ValueError, match=r"shared layer index 4 out of range"):
        layers.shared(4, 2)


def test_unknown_modes(system):
    layers, sub = system
    x = np.random.default_rng(2).standard_normal((3, D))
    with pytest.raises(ValueError, match=r"unknown attention mode 'linear'"):
        check_attention("linear")
    with pytest.raises(ValueError, match=r"unknown attention mode 'linear'"):
        simulate_batch(layers, x, sub, attention="linear")
    with pytest.raises(ValueError, match=r"unknown rule 'post-ln'"):
        check_rule("post-ln")
    with pytest.raises(ValueError, match=r"unknown rule 'post-ln'"):
        simulate_batch(layers, x, sub, rule="post-ln")
    with pytest.raises(ValueError, match=r"unknown rule 'bogus'"):
        layer_step(layers.layer(0), x, np.ones(3, bool), rule="bogus")
    with pytest.raises(ValueError, match=r"unknown order 'largest'"):
        check_order("largest")
    with pytest.raises(ValueError, match=r"unknown order 'largest'"):
        reference_subspaces(layer_spectra(np.eye(3)), order="largest")
    with pytest.raises(ValueError, match=r"unknown kind 'hermitian'"):
        spectrum_matrix([1.0], kind="hermitian")
    with pytest.raises(ValueError, match=r"LayerConfig.norm must be one of"):
        LayerConfig(d_model=4, n_heads=1, d_head=4, norm="batchnorm")
    with pytest.raises(ValueError, match=r"n_heads=3 is not a multiple of n_kv_heads=2"):
        LayerConfig(d_model=4, n_heads=3, n_kv_heads=2, d_head=4)
    with pytest.raises(ValueError, match=r"rule 'full' needs FFN parameters"):
        layer_step(layers.layer(0), x, np.ones(3, bool), rule="full")


def test_spectra_inputs():
    with pytest.raises(ValueError, match=r"spectrum is empty"):
        spectrum_matrix([])
    with pytest.raises(ValueError, match=r"cannot parse eigenvalue 'x2'"):
        parse_spectrum("1,x2")
    with pytest.raises(ValueError, match=r"empty entry in spectrum"):
        parse_spectrum("1,,2")
    with pytest.raises(ValueError, match=r"empty entry in spectrum"):
        parse_spectrum("")
    with pytest.raises(ValueError, match=r"eigenvalue 'inf' is not finite"):
        parse_spectrum("1,inf")
    with pytest.raises(ValueError, match=r"spectrum needs dimension >= 3"):
        spectrum_matrix([1.0, 1 + 1j], d=2)
    with pytest.raises(ValueError, match=r"'symmetric' needs a real spectrum"):
        spectrum_matrix([1 + 1j])
    with pytest.raises(ValueError, match=r"cannot carry a rank-6 F"):
        synthetic_system(None, F=np.eye(6), heads=2, d_head=2)
    with pytest.raises(ValueError, match=r"F must have shape \(L, d, d\)"):
        layer_spectra(np.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match=r"need 0 < k <= d"):
        M.chance_gamma(3, 4)
    with pytest.raises(ValueError, match=r"heads must be positive"):
        synthetic_system([1.0], heads=0)
    assert parse_spectrum(" 3, 1.5+0.5j ,-2") == [3, 1.5 + 0.5j, -2]
