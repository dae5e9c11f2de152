"""The online-softmax attention over key blocks equals the dense masked softmax."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from powerlens._src.dynamics.blocked import blocked_attention_mix


def dense(q, k, v, valid, scale, causal, window, cap):
    """The textbook formula in float64 NumPy: softmax over allowed keys, then A v."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    n = q.shape[0]
    s = scale * np.einsum("ihe,jhe->hij", q, k)
    if cap is not None:
        s = cap * np.tanh(s / cap)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    ok = np.broadcast_to(np.asarray(valid)[None, :], (n, n)).copy()
    if causal:
        ok &= (j <= i) & ((window <= 0) | (j > i - window))
    else:
        ok &= (window <= 0) | (np.abs(i - j) < window)
    s = np.where(ok[None], s, -np.inf)
    mx = np.max(s, -1, keepdims=True)
    p = np.where(ok[None], np.exp(s - np.where(np.isfinite(mx), mx, 0)), 0.0)
    A = p / np.where(p.sum(-1, keepdims=True) > 0, p.sum(-1, keepdims=True), 1)
    return np.einsum("hij,jhe->ihe", A, v)


def case(n, *, seed, H=3, e=4):
    """Random q, k, v "float32[n H e]" and a key mask with about n/4 padding tokens (never token 0)."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((n, H, e)).astype(np.float32) * 2 for _ in range(3))
    valid = np.ones(n, bool)
    valid[rng.integers(0, n, size=max(1, n // 4))] = False
    valid[0] = True
    return q, k, v, valid


@pytest.mark.parametrize("n,block", [(7, 3), (16, 16), (33, 8), (5, 64)])
@pytest.mark.parametrize("causal,window", [(False, 0), (True, 0), (True, 4), (False, 3)])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_blocked_equals_dense(n, block, causal, window, cap):
    q, k, v, valid = case(n, seed=n * 7 + block)
    got = blocked_attention_mix(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(valid), scale=0.5,
                                causal=causal, window=window, cap=cap, block=block)
    ref = dense(q, k, v, valid, 0.5, causal, window, cap)
    np.testing.assert_allclose(np.asarray(got), ref, atol=2e-6, rtol=1e-5)


class _Lp:
    """The few layer fields the dense and query-blocked paths read."""

    def __init__(self, causal, window, cap, scale=0.5):
        import types
        self.config = types.SimpleNamespace(causal=causal, attn_softcap=cap)
        self.window, self.scale = window, scale


@pytest.mark.parametrize("n,block,unrolled", [(7, 3, True), (16, 16, True), (33, 8, True), (33, 8, False),
                                              (5, 64, True)])
@pytest.mark.parametrize("causal,window", [(False, 0), (True, 0), (True, 4), (False, 3)])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_query_blocks_equal_dense(n, block, unrolled, causal, window, cap, monkeypatch):
    """The default path of long prompts: queries by blocks (a causal block reading only the keys
    up to its last query; unrolled, or mapped over the blocks beyond MAX_UNROLLED) gives the
    textbook masked softmax, padding keys, windows and soft-capping included."""
    from powerlens._src.dynamics import attention
    if not unrolled:
        monkeypatch.setattr(attention, "MAX_UNROLLED", 1)
    q, k, v, valid = case(n, seed=n * 11 + block)
    head = lambda a: jnp.swapaxes(jnp.asarray(a), 0, 1)
    got = attention.query_blocked_mix(_Lp(causal, window, cap), head(q), head(k), head(v), jnp.asarray(valid), block)
    ref = dense(q, k, v, valid, 0.5, causal, window, cap)
    ok = valid if causal or window else np.ones(n, bool)     # a query with no allowed key (padding) is not compared
    np.testing.assert_allclose(np.swapaxes(np.asarray(got), 0, 1)[ok], ref[ok], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("n,block", [(16, 16), (33, 8)])
@pytest.mark.parametrize("causal,window", [(False, 0), (True, 0), (True, 4)])
def test_grouped_query_heads_read_their_shared_keys(n, block, causal, window):
    """Grouped-query attention (6 query heads over 2 key/value heads): the keys and values are
    not repeated, yet query head h attends with key/value head h // 3, as transformers'
    ``repeat_kv`` has it; checked against the textbook formula on repeated keys."""
    from powerlens._src.dynamics import attention
    q, _, _, valid = case(n, seed=n * 13 + block, H=6)
    _, k, v, _ = case(n, seed=n * 17 + block, H=2)
    head = lambda a: jnp.swapaxes(jnp.asarray(a), 0, 1)
    got = attention.query_blocked_mix(_Lp(causal, window, None), head(q), head(k), head(v), jnp.asarray(valid), block)
    ref = dense(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1), valid, 0.5, causal, window, None)
    ok = valid if causal or window else np.ones(n, bool)
    np.testing.assert_allclose(np.swapaxes(np.asarray(got), 0, 1)[ok], ref[ok], atol=2e-6, rtol=1e-5)


def test_blocked_is_differentiable_jittable_and_vmappable():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 9, 2, 4)), jnp.float32) for _ in range(3))
    valid = jnp.ones((2, 9), bool)
    f = jax.jit(jax.vmap(lambda q, k, v, m: blocked_attention_mix(q, k, v, m, scale=0.5, causal=True, block=4)))
    g = lambda q: jnp.sum(f(q, k, v, valid) ** 2)

    def dense_sum(q):
        s = 0.5 * jnp.einsum("bihe,bjhe->bhij", q, k)
        s = jnp.where(jnp.tril(jnp.ones((9, 9), bool))[None, None], s, -jnp.inf)
        return jnp.sum(jnp.einsum("bhij,bjhe->bihe", jax.nn.softmax(s, -1), v) ** 2)

    np.testing.assert_allclose(np.asarray(jax.grad(g)(q)), np.asarray(jax.grad(dense_sum)(q)), atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_run_gives_the_same_states_dense_and_blocked(causal):
    """The whole layer scan, with RoPE, GQA, windows per layer and padded prompts: the run's
    ``Dynamics.attention_block`` changes how A is computed, not the states."""
    import powerlens as pl
    layers, x0, valid = _windowed_system(causal, e=4, seed=1)
    states = lambda b: np.asarray(pl.run_batch(layers, x0, valid, dynamics=pl.Dynamics(attention_block=b),
                                               observe=("states",))["states"])
    dense = states(0)
    keep = valid[:, None].repeat(dense.shape[1], 1)
    for b in (None, 4, 64):
        np.testing.assert_allclose(states(b)[keep], dense[keep], atol=2e-5)


def _windowed_system(causal, *, e, seed):
    """(3 random layers of 4 query heads over 2 key/value heads of e dims, d = 16, windows 0,
    3 and 5, RoPE when causal; x0 "float[2 11 16]", valid, the second prompt padded after 7
    tokens)."""
    from powerlens._src.dynamics.params import LayerConfig, make_layers
    rng = np.random.default_rng(seed)
    U, H, G, d, n = 3, 4, 2, 16, 11
    cfg = LayerConfig(d_model=d, n_heads=H, n_kv_heads=G, d_head=e, causal=causal, norm="l2",
                      rope_theta=100.0 if causal else None)
    layers = make_layers(rng.standard_normal((U, G, e, d)) / 4, rng.standard_normal((U, d, H * e)) / 4,
                         W_q=rng.standard_normal((U, H, e, d)), W_k=rng.standard_normal((U, G, e, d)),
                         window=np.array([0, 3, 5]), config=cfg)
    x0 = rng.standard_normal((2, n, d)).astype(np.float32)
    valid = np.ones((2, n), bool)
    valid[1, 7:] = False
    return layers, x0, valid


def test_attention_block_must_be_a_size():
    from powerlens._src.dynamics.options import Dynamics
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="Dynamics.attention_block"):
            Dynamics(attention_block=bad)


@pytest.mark.parametrize("n", [9, 16])
@pytest.mark.parametrize("causal,window", [(False, 0), (True, 0), (True, 4), (False, 3)])
@pytest.mark.parametrize("groups", [1, 3])
def test_fused_call_equals_dense(n, causal, window, groups):
    """``attention_block="cudnn"``'s one ``jax.nn.dot_product_attention`` call, made here through
    XLA (cuDNN needs a GPU): the additive mask (causal, window, padding keys), the pre-scaled
    queries and the grouped key/value heads give the textbook masked softmax."""
    from powerlens._src.dynamics import attention
    q, _, _, valid = case(n, seed=n * 19 + groups, H=6)
    _, k, v, _ = case(n, seed=n * 23 + groups, H=6 // groups)
    got = attention.fused_attention_mix(_Lp(causal, window, None), jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                        jnp.asarray(valid), implementation="xla")
    ref = dense(q, np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1), valid, 0.5, causal, window, None)
    ok = valid if causal or window else np.ones(n, bool)
    np.testing.assert_allclose(np.asarray(got)[ok], ref[ok], atol=2e-6, rtol=1e-5)


def test_run_through_the_fused_call_gives_the_same_states(monkeypatch):
    """The layer scan with ``Dynamics(attention_block="cudnn")`` (RoPE, grouped heads, a window
    per layer, a padded prompt), its call made through XLA and its GPU check passed: the states
    of the default path. On this CPU the setting itself is refused, in one line."""
    import functools
    import powerlens as pl
    from powerlens._src.dynamics import attention
    layers, x0, valid = _windowed_system(True, e=8, seed=2)
    fused = pl.Dynamics(attention_block="cudnn")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match=r"Dynamics\.attention_block='cudnn' needs an NVIDIA GPU"):
            pl.run_batch(layers, x0, valid, dynamics=fused, observe=("states",))
    monkeypatch.setattr(attention, "check_fused_attention", lambda lp, dtype: None)
    monkeypatch.setattr(attention, "fused_attention_mix",
                        functools.partial(attention.fused_attention_mix, implementation="xla"))
    got = np.asarray(pl.run_batch(layers, x0, valid, dynamics=fused, observe=("states",))["states"])
    ref = np.asarray(pl.run_batch(layers, x0, valid, observe=("states",))["states"])
    keep = valid[:, None].repeat(ref.shape[1], 1)
    np.testing.assert_allclose(got[keep], ref[keep], atol=2e-5)


def test_fused_attention_names_what_it_lacks():
    """Where cuDNN's attention cannot run, one line says why: no GPU, a float32 system, a
    soft-capped layer, a head dim it has no kernel for. Any other string is not a setting."""
    import types
    from powerlens._src.dynamics.attention import check_fused_attention
    from powerlens._src.dynamics.options import Dynamics
    lp = lambda cap=None, e=64: types.SimpleNamespace(config=types.SimpleNamespace(attn_softcap=cap, d_head=e))
    check_fused_attention(lp(), jnp.bfloat16, backend="gpu")                  # applies: nothing raised
    check_fused_attention(lp(), jnp.float16, backend="gpu")
    for args, why in (((lp(), jnp.bfloat16, "cpu"), "needs an NVIDIA GPU.*'cpu'"),
                      ((lp(), jnp.float32, "gpu"), "float16 or bfloat16 system.*float32"),
                      ((lp(cap=50.0), jnp.bfloat16, "gpu"), "soft-cap.*attn_softcap=50.0"),
                      ((lp(e=12), jnp.bfloat16, "gpu"), "multiple of 8.*d_head=12"),
                      ((lp(e=512), jnp.bfloat16, "gpu"), "at most 256.*d_head=512")):
        with pytest.raises(ValueError, match=why):
            check_fused_attention(*args[:2], backend=args[2])
    assert Dynamics(attention_block="cudnn").attention_block == "cudnn"
    for bad in ("cuDNN", "xla", "128"):
        with pytest.raises(ValueError, match=r"Dynamics\.attention_block.*'cudnn'"):
            Dynamics(attention_block=bad)
