"""Each scan step upcasts its own layer only, in the KV-cache generation and in steering's runs.

A bf16 model computed in float32 casts one layer per scan step. Without an optimization
barrier between the loop-invariant stack and that cast, XLA's CPU compiler hoists the cast of
every layer out of the loop: a float32 copy of the whole stack, held while the scan runs.
Counted here from the compiled programs' temporary buffers (``memory_analysis``), with 8
layers so that one layer is an eighth of the stack: the prefill (``generate``'s first
program), the decoding loop (its second) and steering's differentiated tail of layers
(:func:`powerlens._src.steering.alpha.run_tail`, forward) each stay under a quarter of one
float32 copy of the stack; the LM head (cast a block of rows at a time) and the decoding loop's
embedding lookup (the table carried behind a barrier) under a quarter of one float32 head;
``pl.trace`` builds no (in, out) copies of the layers when they are cast per step. The barrier changes no number: bf16 storage gives exactly the
float32-stored model's tokens, and a float32 model's cache and states are the plain scan's.
"""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import powerlens as pl
from powerlens._src.models import generate as gen
from powerlens._src.models import kv_cache

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import scale  # noqa: E402

CFG = dict(scale.TINY, num_hidden_layers=8, hidden_size=128, intermediate_size=256)
PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 1, 2]]
NEW = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return scale.write_checkpoint(str(tmp_path_factory.mktemp("scans") / "eight"), CFG, seed=4, progress=False)


def stack_f32(layers, names=("W_q", "W_k", "W_v", "W_o", "W_in", "W_gate", "W_out")) -> int:
    """Bytes of one float32 copy of the named weight stacks "[L ...]"."""
    return sum(4 * int(getattr(layers, n).size) for n in names if getattr(layers, n) is not None)


def generate_programs(model):
    """The compiled prefill (``_start``) and decoding loop (``_steps``) of generate, as it calls them."""
    lengths = np.asarray([len(p) for p in PROMPTS], np.int32)
    n = int(lengths.max())
    buf = np.zeros((len(PROMPTS), n), np.int32)
    for b, p in enumerate(PROMPTS):
        buf[b, :len(p)] = p
    x0, valid = pl.embed(model, PROMPTS)
    args = (jnp.asarray(lengths), jnp.zeros((0,), jnp.int32), None, dict(key=None, temperature=None, top_p=None),
            None, None)
    kw = dict(size=n + NEW - 1, n_new=NEW, chunk=None, pad=0, top_k=None)
    start = gen._start.lower(model, x0, valid, *args, **kw).compile()
    state = gen._start(model, x0, valid, *args, **kw)
    steps = gen._steps.lower(model, state, jnp.int32(NEW), *args, None, pad=0, top_k=None).compile()
    return start, steps


_TEMPS = """
import json, sys
sys.path.insert(0, sys.argv[2])
import powerlens as pl
from lazy_dtype_scans_cases import generate_programs
start, steps = generate_programs(pl.load(sys.argv[1]))
print(json.dumps({"prefill": start.memory_analysis().temp_size_in_bytes,
                  "decode": steps.memory_analysis().temp_size_in_bytes}))
"""


def generate_temps(folder) -> dict:
    """Temporary bytes of generate's two compiled programs for the model in ``folder``, compiled
    in a fresh process: in a long-lived test process that had compiled many programs before,
    XLA's CPU compiler crashed twice while compiling them (never in a fresh one)."""
    import json
    import subprocess
    r = subprocess.run([sys.executable, "-c", _TEMPS, str(folder), os.path.dirname(os.path.abspath(__file__))],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_prefill_and_decode_upcast_one_layer_at_a_time(folder):
    m = pl.load(folder)
    assert m.layers.W_q.dtype == jnp.bfloat16 and m.layers.dtype == jnp.float32
    whole = stack_f32(m.layers)
    one_layer = whole // CFG["num_hidden_layers"]
    for name, temp in generate_temps(folder).items():
        assert temp < whole / 4, (name, temp, whole, one_layer)


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory):
    """A bf16 checkpoint whose word embeddings and LM head (16384 x 128 each) outweigh its layers."""
    cfg = dict(CFG, num_hidden_layers=2, vocab_size=16384)
    return scale.write_checkpoint(str(tmp_path_factory.mktemp("vocab") / "wide"), cfg, seed=6, progress=False)


def test_the_head_and_the_decoding_loop_upcast_no_whole_table(big_vocab):
    """The LM head is cast a block of rows at a time (``forward._head``), and the decoding loop
    reads one row of the word embeddings per step without a float32 copy of the table hoisted
    out of the loop: each program's temporaries stay under a quarter of one float32 head."""
    from powerlens._src.models import forward
    m = pl.load(big_vocab)
    W = m.lm_head
    head_f32 = 4 * int(W.size)
    assert W.dtype == jnp.bfloat16 and m.embeddings["word"].dtype == jnp.bfloat16
    h = jnp.ones((2, 5, CFG["hidden_size"]), jnp.float32)
    temp = forward._head.lower(h, W, None, cap=None).compile().memory_analysis().temp_size_in_bytes
    assert temp < head_f32 / 4, (temp, head_f32)
    for name, temp in generate_temps(big_vocab).items():
        assert temp < head_f32 / 4, (name, temp, head_f32)
    # the same numbers as the float32 head of the same values (another order of the sums over d)
    z = np.asarray(forward._head(h * jnp.arange(1, 1 + CFG["hidden_size"]) / 50.0, W, None, cap=None))
    ref = (np.asarray(h) * np.arange(1, 1 + CFG["hidden_size"]) / 50.0) @ np.asarray(W, np.float64).T
    np.testing.assert_allclose(z, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_the_barrier_changes_no_number(folder):
    """bf16 held and float32 compute: the tokens of the float32-stored model of the same values;
    a float32 model's prefill and decode equal a plain scan over its layers (no barrier, no
    cast) written out here from the same step functions, bit for bit."""
    b = pl.load(folder)
    f = pl.load(folder, dtype="float32")
    gb = pl.generate(b, PROMPTS, max_new_tokens=NEW).new_ids
    gf = pl.generate(f, PROMPTS, max_new_tokens=NEW).new_ids
    assert gb == gf
    x0, valid = pl.embed(f, PROMPTS)
    h, cache = jax.jit(lambda m, x, v: kv_cache.prefill(m, x, v, None, size=9))(f, x0, valid)
    ks, vs = [], []
    for bi in range(len(PROMPTS)):
        X = kv_cache.inert_padding(jnp.asarray(x0[bi]), valid[bi])
        pos = jnp.arange(X.shape[0])

        def plain(X, u, bi=bi, pos=pos):
            from powerlens._src.dynamics.attention import softmax_mix, softmax_qkv
            from powerlens._src.dynamics.layer import full_attention_input, full_block, head_output
            lp = f.layers.layer(u)
            q, k, v = softmax_qkv(lp, full_attention_input(lp, X), pos, None)
            M = softmax_mix(lp, q, k, v, valid[bi])
            Y = full_block(lp, X, head_output(lp, M.reshape(X.shape[0], -1), keep_bias=True, out=None))
            return kv_cache.inert_padding(Y, valid[bi]), (k, v)
        Y, (k, v) = jax.jit(lambda X: jax.lax.scan(plain, X, jnp.arange(CFG["num_hidden_layers"])))(X)
        last = int(np.sum(valid[bi])) - 1
        np.testing.assert_allclose(np.asarray(h[bi]), np.asarray(Y[last]), rtol=0, atol=1e-5)
        ks.append(k)
        vs.append(v)
    np.testing.assert_allclose(np.asarray(cache.k[:, :, :, :6]), np.stack(ks, 1), rtol=0, atol=1e-5)


def test_steering_tail_upcasts_one_layer_at_a_time(folder):
    """The tail of layers the steering optimiser runs (:func:`~powerlens._src.steering.alpha.run_tail`
    over every layer: the first one edited), rules paper and full."""
    from powerlens._src.steering.alpha import run_tail
    m = pl.load(folder)
    L = m.layers
    x0, valid = pl.embed(m, PROMPTS)
    X = jnp.asarray(x0, jnp.float32)
    tail = tuple(L.schedule)
    for rule, names in (("paper", ("W_q", "W_k", "W_v", "W_o")),
                        ("full", ("W_q", "W_k", "W_v", "W_o", "W_in", "W_gate", "W_out"))):
        fn = lambda L, rule=rule: run_tail(L, X, valid, tail, rule=rule, attention="softmax", keep_bias=True)
        temp = jax.jit(fn).lower(L).compile().memory_analysis().temp_size_in_bytes
        assert temp < stack_f32(L, names) / 4, (rule, temp, stack_f32(L, names))


def test_trace_of_a_bf16_model_builds_no_float32_copies(folder, monkeypatch):
    """``pl.trace`` of weights held in bf16 casts a layer per step as ``run_states`` does, and
    builds no prepared (in, out) copies of every layer's attention (float32: 5 GB at
    Llama-3-8B's shape); its states are those of the float32-stored model of the same values."""
    from powerlens._src.analysis import trace as trace_module
    built = []
    real = trace_module.prepared_projections
    monkeypatch.setattr(trace_module, "prepared_projections",
                        lambda layers, *a, **k: built.append(str(layers.storage_dtype)) or real(layers, *a, **k))
    b = pl.load(folder)
    f = pl.load(folder, dtype="float32")
    tb = pl.trace(b, PROMPTS, rule="full")
    tf = pl.trace(f, PROMPTS, rule="full")
    assert built == ["float32"]
    scale_ = np.abs(np.asarray(tf.states)).max()
    np.testing.assert_allclose(np.asarray(tb.states), np.asarray(tf.states), rtol=0, atol=1e-5 * scale_)
    np.testing.assert_allclose(np.asarray(tb.logits), np.asarray(tf.logits), rtol=0,
                               atol=1e-5 * np.abs(np.asarray(tf.logits)).max())
