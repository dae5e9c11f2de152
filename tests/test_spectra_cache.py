"""The spectra of a model are computed once per set of weights and recomputed after an edit.

``pl.trace`` and ``pl.align_model`` take a model's spectra from ``spectra_of``, which keeps them
while the model's (immutable) JAX arrays W_o and W_v live. The tests count the calls of the
eigen-solver entry point ``layer_spectra`` (no timing), and check the edited model's spectra
against an independent dense float64 ``numpy.linalg.eigvals`` of F' = (W_o + ΔO) V_cat.
"""
from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import powerlens as pl
from powerlens._src.analysis import spectra as S
from powerlens._src.dynamics import cache
from powerlens._src.dynamics.params import LayerConfig, make_layers
from powerlens._src.models.base import Model, ModelInfo

D, H, E, L, VOCAB = 8, 2, 3, 2, 5
PROMPTS = [[1, 2, 3, 4], [4, 0, 2]]


def tiny_decoder(seed: int = 0, as_jax: bool = True) -> Model:
    """Two pre-norm causal blocks (l2 norm, FFN of zeros), a tied head; JAX (or NumPy) arrays."""
    rng = np.random.default_rng(seed)
    cfg = LayerConfig(d_model=D, n_heads=H, n_kv_heads=H, d_head=E, norm="l2", norm_placement="pre", causal=True,
                      ffn_activation="relu")
    f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
    layers = make_layers(W_v=f32(L, H, E, D), W_o=f32(L, D, H * E), W_q=f32(L, H, E, D), W_k=f32(L, H, E, D),
                         W_in=np.zeros((L, 4, D), np.float32), W_out=np.zeros((L, D, 4), np.float32), config=cfg)
    names = ("W_q", "W_k", "W_v", "W_o", "W_in", "W_out")
    conv = jnp.asarray if as_jax else np.asarray
    layers = layers.replace(**{k: conv(np.asarray(getattr(layers, k), np.float32)) for k in names})
    return Model(layers=layers, embeddings={"word": conv(f32(VOCAB, D))},
                 info=ModelInfo(family="synthetic", source="", decoder=True, pad_token_id=0))


@pytest.fixture
def calls(monkeypatch):
    """The number of calls of the eigen-solver entry point, counted from here on."""
    count = [0]
    real = S.layer_spectra

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(S, "layer_spectra", counting)
    return count


def _dense_eigenvalues(layers, u: int) -> np.ndarray:
    """Eigenvalues of F_u = W_o[u] V_cat[u] in float64, by a dense eig (not powerlens'),
    sorted by decreasing |1 + lambda| (the shifted ordering), ties by the angle."""
    Wo = np.asarray(layers.W_o[u], np.float64)
    Wv = np.asarray(layers.W_v[u], np.float64).reshape(H * E, D)          # no GQA here: V_cat
    w = np.linalg.eigvals(Wo @ Wv)
    return w[np.lexsort((w.imag, -np.round(np.abs(1 + w), 9)))]


def _sorted(ev: np.ndarray) -> np.ndarray:
    return ev[np.lexsort((ev.imag, -np.round(np.abs(1 + ev), 9)))]


def test_second_trace_does_not_recompute_the_spectra(calls):
    model = tiny_decoder()
    first = pl.trace(model, PROMPTS)
    assert calls[0] == 1
    second = pl.trace(model, PROMPTS, order="plain")
    pl.align_model(model, PROMPTS, dynamics=pl.Dynamics())
    assert calls[0] == 1                                    # the trace and the align reuse them
    assert [s is t for s, t in zip(first.spectra, second.spectra)] == [True] * L
    np.testing.assert_array_equal(np.asarray(first.states), np.asarray(second.states))


def test_an_edit_invalidates_the_spectra(calls):
    model = tiny_decoder()
    before = pl.trace(model, PROMPTS)
    rng = np.random.default_rng(3)
    dO = rng.normal(size=(D, H * E)).astype(np.float32)                 # a rank-6 edit of the last layer
    edited = pl.steered_model(model, dO, 1)
    after = pl.trace(edited, PROMPTS)
    assert calls[0] == 2                                    # the edited model's spectra are computed afresh
    for u in range(L):
        got = _sorted(np.asarray(after.spectra[u].shifted.eigenvalues))
        np.testing.assert_allclose(got, _dense_eigenvalues(edited.layers, u), atol=1e-9, rtol=1e-9)
    # layer 0 is untouched, layer 1 is not: its spectrum moved
    np.testing.assert_allclose(after.spectra[0].shifted.eigenvalues, before.spectra[0].shifted.eigenvalues,
                               atol=1e-12)
    old = _sorted(np.asarray(before.spectra[1].shifted.eigenvalues))
    new = _sorted(np.asarray(after.spectra[1].shifted.eigenvalues))
    assert np.max(np.abs(new - old)) > 0.1
    np.testing.assert_allclose(old, _dense_eigenvalues(model.layers, 1), atol=1e-9, rtol=1e-9)
    # the original model still gets its own spectra, from the cache
    again = pl.trace(model, PROMPTS)
    assert calls[0] == 2 and again.spectra[1] is before.spectra[1]


def test_numpy_weights_are_never_cached(calls):
    """NumPy arrays are mutable (their identity does not name their contents): every call computes."""
    layers = tiny_decoder(as_jax=False).layers
    first = S.spectra_of(layers)
    second = S.spectra_of(layers)
    assert calls[0] == 2 and first[1] is not second[1]
    np.testing.assert_allclose(_sorted(second[1].shifted.eigenvalues), _dense_eigenvalues(layers, 1), atol=1e-9)


def test_the_entry_goes_with_the_weights():
    """The cache holds weak references: dropping the model drops its spectra."""
    model = tiny_decoder(seed=11)
    S.spectra_of(model.layers)
    key_ids = {id(model.layers.W_o), id(model.layers.W_v)}
    held = lambda: [k for k in cache._CACHE if isinstance(k[0], str) and k[0].startswith("spectra/")
                    and set(k[1:]) == key_ids]
    assert len(held()) == 1
    del model
    gc.collect()
    jax.clear_caches()          # compiled programs may hold the arrays as constants: none here, but be sure
    gc.collect()
    assert held() == []


def test_the_one_layer_at_a_time_path_is_kept_too(monkeypatch):
    """A model too large for every F_t at once gets its spectra one layer at a time
    (``spectra_by_layer``): computed once as well, the same numbers as the whole stack's."""
    from powerlens._src.analysis import alignment
    count = [0]
    real = alignment.spectra_by_layer

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(alignment, "whole_stack_fits", lambda layers: False)
    monkeypatch.setattr(alignment, "spectra_by_layer", counting)
    model = tiny_decoder(seed=21)
    first = pl.trace(model, PROMPTS)
    second = pl.trace(model, PROMPTS)
    assert count[0] == 1 and second.spectra[0] is first.spectra[0]
    for u in range(L):
        np.testing.assert_allclose(_sorted(first.spectra[u].shifted.eigenvalues), _dense_eigenvalues(model.layers, u),
                                   atol=1e-9)
