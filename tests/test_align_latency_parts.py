"""A warm one-prompt ``align`` makes only the programs it needs, and imports nothing it does not use.

Every JAX program a command makes costs it, on a warm run, a trace, a lowering and a read from
the persistent compilation cache (about 10 ms each on a 2-core machine, more than the arithmetic
of a small model); an eager op (``jnp.asarray`` of a host array, ``jnp.full``, a reshape, an
einsum) is such a program of its own. So loading makes none, the host copies of F and its factors
are one program, and the prompt mask and the reference subspaces go to the device without one.
The tests count the programs by name from JAX's compile log (no timing) and check that the
numbers are the bits of the eager ops, against an independent float64 NumPy product. A
subprocess checks that a run of ``align_model`` and its figure imports neither ``tqdm.auto``
nor ``matplotlib.pyplot``.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from powerlens._src.analysis import spectra as S
from powerlens._src.dynamics.params import LayerConfig, layer_factors, layer_matrices, make_layers
from powerlens._src.models.base import Model, ModelInfo

# sizes no other test uses, so that nothing is found in JAX's in-memory caches by chance
D, H, E, L, VOCAB, P = 10, 2, 5, 3, 11, 16
PROMPT = [[1, 4, 2, 9, 3, 7]]


def tiny_encoder(seed: int = 0, kv_heads: int = H) -> Model:
    """Three post-LN encoder layers with biases and an embedding LayerNorm (a BERT in small)."""
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: (rng.normal(size=shape) / np.sqrt(shape[-1])).astype(np.float32)
    cfg = LayerConfig(d_model=D, n_heads=H, n_kv_heads=kv_heads, d_head=E, causal=False, norm="layernorm",
                      norm_eps=1e-12, norm_placement="post", ffn_activation="gelu")
    layers = make_layers(W_v=f32(L, kv_heads, E, D), W_o=f32(L, D, H * E), W_q=f32(L, H, E, D),
                         W_k=f32(L, kv_heads, E, D), b_q=f32(L, H, E), b_k=f32(L, kv_heads, E),
                         b_v=f32(L, kv_heads, E), b_o=f32(L, D), norm_scale=1 + f32(L, D), norm_bias=f32(L, D),
                         config=cfg)
    emb = {"word": jnp.asarray(f32(VOCAB, D) * 3), "position": jnp.asarray(f32(P, D) * 3),
           "norm_scale": jnp.asarray(1 + f32(D)), "norm_bias": jnp.asarray(f32(D))}
    return Model(layers=layers, embeddings=emb, info=ModelInfo(family="bert", source="", max_positions=P,
                                                              pad_token_id=0))


@contextlib.contextmanager
def programs():
    """The names of the XLA programs made inside the block (compiled, or read back from the
    persistent cache), from JAX's compile log; JAX's in-memory caches are emptied first, so
    that every program the block needs is made in it, as in a fresh process."""
    names = []

    class Names(logging.Handler):
        def emit(self, record):
            m = re.match(r"Compiling (?:jit\()?([^) ]+)", record.getMessage())
            if m:
                names.append(m.group(1))

    handler = Names(level=logging.DEBUG)
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    jax.clear_caches()
    try:
        with jax.log_compiles(True):
            yield names
    finally:
        logger.removeHandler(handler)


def test_loading_minilm_makes_no_program():
    """Reading a checkpoint places its arrays on the device and fills in the default softmax
    scales 1/sqrt(e) and windows 0 on the host: no program (before: four, for jnp.full and
    jnp.zeros), the same values."""
    from powerlens._src.models import load
    with programs() as made:
        model = load("minilm", parts="attention")
    assert made == []
    e = model.layers.config.d_head
    np.testing.assert_array_equal(np.asarray(model.layers.scale), np.full(6, 1 / np.sqrt(e), np.float32))
    assert model.layers.window.dtype == jnp.int32 and not np.asarray(model.layers.window).any()


@pytest.mark.parametrize("kv_heads", [H, 1])
def test_host_layer_matrices_is_one_program_with_the_eager_bits(kv_heads):
    """F "float[U d d]" and its factors A "float[U d r]", B "float[U r d]" come from one
    program (before: seven eager ops), bit for bit what the eager ops give, and F is the
    float64 product W_o V_cat (query heads sharing a key/value head read its W_v) up to
    float32 rounding, and equal to A B."""
    layers = tiny_encoder(kv_heads=kv_heads).layers
    with programs() as made:
        F, (A, B) = S.host_layer_matrices(layers)
    assert made == ["_layer_arrays"]
    np.testing.assert_array_equal(F, np.asarray(layer_matrices(layers)))
    np.testing.assert_array_equal(A, np.asarray(layer_factors(layers)[0]))
    np.testing.assert_array_equal(B, np.asarray(layer_factors(layers)[1]))
    Wv = np.repeat(np.asarray(layers.W_v, np.float64), H // kv_heads, axis=1).reshape(L, H * E, D)
    F64 = np.einsum("udk,ukc->udc", np.asarray(layers.W_o, np.float64), Wv)
    np.testing.assert_allclose(F, F64, rtol=0, atol=1e-5 * np.abs(F64).max())
    np.testing.assert_allclose(np.einsum("udr,urc->udc", A.astype(np.float64), B), F64, rtol=0,
                               atol=1e-5 * np.abs(F64).max())
    assert A.shape == (L, D, kv_heads * E) and B.shape == (L, kv_heads * E, D)


def test_reference_subspaces_go_to_the_device_without_a_program():
    """The reference subspaces are the float64 bases rounded once to float32 (as before), and
    their dims, both placed on the device without a compiled copy."""
    layers = tiny_encoder().layers
    spectra = S.spectra_of(layers)
    with programs() as made:
        subs = S.reference_subspaces(spectra, order="shifted", seed=3, dtype=jnp.float32)
    assert made == []
    assert subs.basis.dtype == jnp.float32 and subs.dim.dtype == jnp.int32
    for u, s in enumerate(spectra):
        k = s.shifted.basis.shape[1]
        np.testing.assert_array_equal(np.asarray(subs.basis[u, 0, :, :k]), s.shifted.basis.astype(np.float32))
        assert int(subs.dim[u, 0]) == k
    old = S.jnp.asarray(np.asarray(subs.basis, np.float64), jnp.float32)          # the eager path of before
    np.testing.assert_array_equal(np.asarray(subs.basis), np.asarray(old))


def test_embed_is_one_program_and_its_mask_a_copy():
    """x0 comes from ``embed_arrays`` alone (before: and a copy program for the mask); the mask
    returned is a copy, not a view of the caller's array."""
    from powerlens._src.models.embed import embed_ids
    model = tiny_encoder()
    ids = np.asarray(PROMPT, np.int32)
    valid = np.ones(ids.shape, bool)
    with programs() as made:
        x0, mask = embed_ids(model, ids, valid)
    assert made == ["embed_arrays"]
    valid[0, 0] = False
    assert isinstance(mask, jax.Array) and bool(np.asarray(mask).all())
    # x0 = LN(word[ids] + position[0..n-1]), in float64 by hand
    E_ = {k: np.asarray(v, np.float64) for k, v in model.embeddings.items()}
    h = E_["word"][ids[0]] + E_["position"][np.arange(ids.shape[1])]
    h = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-12)
    np.testing.assert_allclose(np.asarray(x0[0]), h * E_["norm_scale"] + E_["norm_bias"], rtol=0, atol=2e-5)


def test_a_one_prompt_align_makes_only_its_own_programs():
    """After loading, a one-prompt align (the host matrices, the spectra, x0, both orderings)
    makes five programs, each once: none for an eager op, none again for the second ordering."""
    from powerlens._src.analysis.alignment import align_model
    from powerlens._src.models.embed import embed
    model = tiny_encoder(seed=1)
    with programs() as made:
        F, factors = S.host_layer_matrices(model.layers)
        spectra = S.layer_spectra(F, factors=factors)
        x0, valid = embed(model, PROMPT)
        result = align_model(model, PROMPT, x0=x0, valid=valid, spectra=spectra)
    assert sorted(made) == sorted(["_layer_arrays", "embed_arrays", "build_projections", "complex_pair_planes",
                                   "_simulate_batch"]), made
    assert result.n_tokens == len(PROMPT[0]) and set(result.measures) == {"shifted", "plain"}


_NO_EXTRA_IMPORTS = """
import sys, tempfile
sys.path.insert(0, {tests!r})
from test_align_latency_parts import PROMPT, tiny_encoder
from powerlens._src.analysis.alignment import align_model
result = align_model(tiny_encoder(), PROMPT, progress=True)
result.plot(tempfile.mkdtemp(), title="tiny")
print("tqdm.auto" in sys.modules, "matplotlib.pyplot" in sys.modules)
"""


def test_align_and_its_figure_import_neither_tqdm_auto_nor_pyplot():
    """Outside a notebook the progress bar is tqdm's plain one (``tqdm.auto`` would import
    its notebook and asyncio variants, about 0.05 s of a warm run), and the figure is drawn on the Agg canvas directly
    (pyplot would add its own import and global state)."""
    code = textwrap.dedent(_NO_EXTRA_IMPORTS).format(tests=os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-2:] == ["False", "False"], r.stdout
