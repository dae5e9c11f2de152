"""Attention patterns and the head-wise mixing M_h = A_h X.

Modes (design.md §1):

    softmax   A_h = softmax(scale (X W_qh^T + b_qh)(X W_kh^T + b_kh)^T + mask), with the
              causal mask, a local window (token i sees j with i - window < j <= i) and a
              key padding mask; RoPE on q and k when the config asks for it.
              Decoder refinements, all of which only shape A: per-head RMSNorm of q and k
              before RoPE (``q_norm_scale``/``k_norm_scale``: Qwen3, Gemma 3), a RoPE base
              per layer (``rope_base``: Gemma 3), and soft-capped scores
              s -> cap tanh(s / cap), s = scale q.k, before the mask (``attn_softcap``: Gemma 2).
    uniform   A = 1/n over the valid tokens, or the causal mean over j <= i.
    identity  A = I.

All functions are written for one prompt, X "float[n d]", ``valid`` "bool[n]", and are
batched with ``vmap``. Softmax attention has one implementation: q, k and v come from one
fused projection (:func:`~powerlens._src.dynamics.projections.qkv_weight`), then the masked softmax,
scheduled dense, by query blocks or by key blocks, or handed to cuDNN's fused kernel on a GPU
(the run's choice, ``Dynamics.attention_block``; :func:`softmax_attention_mix`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import execution
from .blocked import blocked_attention_mix
from .norms import apply_norm

ATTENTION_MODES = ("softmax", "uniform", "identity")

FUSED_ATTENTION = "cudnn"
"""The ``attention_block`` of cuDNN's fused attention (:func:`fused_attention_mix`)."""


def check_attention_block(block, where: str = "attention_block"):
    """``block`` if it is an ``attention_block`` setting (None, an int >= 0 or
    :data:`FUSED_ATTENTION`: see :func:`softmax_attention_mix`), else a one-line ValueError
    naming ``where``."""
    size = isinstance(block, (int, np.integer)) and not isinstance(block, (bool, np.bool_)) and block >= 0
    if not (block is None or size or (isinstance(block, str) and block == FUSED_ATTENTION)):
        raise ValueError(f"{where} must be None (automatic), 0 (dense), a positive block size or "
                         f"{FUSED_ATTENTION!r}, got {block!r}")
    return block


def check_attention(mode: str) -> str:
    if mode not in ATTENTION_MODES:
        raise ValueError(f"unknown attention mode {mode!r}; expected one of {ATTENTION_MODES}")
    return mode


def allowed_keys(n: int, valid, *, causal: bool, window=0):
    """"bool[n n]": may query i attend to key j."""
    i = jnp.arange(n)[:, None]
    j = jnp.arange(n)[None, :]
    ok = jnp.broadcast_to(valid[None, :], (n, n))
    if causal:
        ok = ok & (j <= i)
        ok = ok & ((window <= 0) | (j > i - window))
    else:
        ok = ok & ((window <= 0) | (jnp.abs(i - j) < window))
    return ok


def rotate_half(x):
    h = x.shape[-1] // 2
    return jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def apply_rope(x, positions, theta, rope_dim=None):
    """Hugging Face (``rotate_half``) rotary embedding on the last axis of x "float[... n e]".

    ``theta``: the base, a float or a traced scalar (a per-layer ``rope_base`` inside the scan);
    the frequencies theta^(-2i/r) are formed in float32, as transformers does."""
    e = x.shape[-1]
    r = e if rope_dim is None else rope_dim
    inv_freq = 1.0 / (theta ** (jnp.arange(0, r, 2, dtype=jnp.float32) / r))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    xr, xp = x[..., :r], x[..., r:]
    xr = xr * cos + rotate_half(xr) * sin
    return jnp.concatenate([xr, xp], axis=-1) if r < e else xr


def key_bias(n: int, valid, *, causal: bool, window=0, dtype=jnp.float32):
    """"float[n n]" additive mask: 0 where query i may attend to key j (:func:`allowed_keys`),
    the most negative finite number elsewhere, so exp(s + bias - max) is exactly 0 there. A
    query with no allowed key (only a padding query can have none) gets uniform weights."""
    return jnp.where(allowed_keys(n, valid, causal=causal, window=window), 0, jnp.finfo(dtype).min).astype(dtype)


def dense_softmax_mix(lp, q, k, v, bias):
    """softmax(cap(scale q k^T) + bias) v "float[H m e]" for head-major queries q "float[H m e]",
    keys and values k, v "float[G j e]" of the G = H / r key/value heads (query head h reads
    key/value head h // r, as Hugging Face's ``repeat_kv``) and the additive mask bias
    "float[m j]" (:func:`key_bias`).

    The r query heads of a group are one matmul against their shared keys ("float[G r m e]"
    against "float[G j e]"), so the keys and values are never repeated to H heads. The
    softmax is left unnormalised until after the value matmul, M = (P v) / (P 1) with
    P = exp(s - max_j s), so the division touches "float[H m e]" instead of "float[H m j]";
    the scale multiplies q (m e numbers, not m j), and the mask is one addition shared by the
    heads. Measured on this project's CPU machine (MiniLM, 32 x 128 tokens, 6 layers): 357 ms
    with ``jnp.where`` on the scores and ``jax.nn.softmax``, 240 ms this way."""
    cap = lp.config.attn_softcap
    H, m, e = q.shape
    G = k.shape[0]
    # r = H / G query heads per key head; with r = 1 the group axis is left out, since a
    # size-1 axis in the scores made XLA copy them to another layout (6 MB a layer at 8 x 128)
    qg, sub = (q, "h") if G == H else (q.reshape(G, H // G, m, e), "gr")
    if cap is None:
        s = jnp.einsum(f"{sub}me,{sub[0]}je->{sub}mj", qg * jnp.asarray(lp.scale, q.dtype), k)
    else:
        s = cap * jnp.tanh(lp.scale * jnp.einsum(f"{sub}me,{sub[0]}je->{sub}mj", qg, k) / cap)
    s = s + bias
    P = jnp.exp(s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
    M = jnp.einsum(f"{sub}mj,{sub[0]}je->{sub}me", P, v) / jnp.sum(P, axis=-1, keepdims=True)
    return M.reshape(H, m, e)


def query_blocked_mix(lp, q, k, v, valid, block: int):
    """M "float[H n e]" of :func:`dense_softmax_mix` computed for ``block`` queries at a time
    (head-major q "float[H n e]", k, v "float[G n e]"): the scores of one query block, "float[H block n]", stay
    in the CPU's cache between the score matmul, the softmax and the value matmul, where the
    whole "float[H n n]" tensor goes through memory several times, and memory is O(n * block).
    A causal model's query block b only reads the keys up to its last query (the keys after
    it are masked anyway), which halves the work of long prompts. The blocks are unrolled
    (static slices), up to :data:`MAX_UNROLLED` of them; longer prompts map over the blocks.

    Measured (one attention core, 8 prompts x 512 tokens, 12 heads of 32, vmapped): 117 ms
    dense, 33 ms by query blocks of 128; torch's ``scaled_dot_product_attention`` 36 ms."""
    H, n, e = q.shape
    cfg = lp.config
    bias = key_bias(n, valid, causal=cfg.causal, window=lp.window, dtype=q.dtype)
    nb = -(-n // block)
    if nb <= MAX_UNROLLED:
        outs = []
        for b in range(nb):
            lo, hi = b * block, min((b + 1) * block, n)
            keys = hi if cfg.causal else n
            outs.append(dense_softmax_mix(lp, q[:, lo:hi], k[:, :keys], v[:, :keys], bias[lo:hi, :keys]))
        return jnp.concatenate(outs, axis=1)
    pad = nb * block - n
    qb = jnp.pad(q, ((0, 0), (0, pad), (0, 0))).reshape(H, nb, block, e).swapaxes(0, 1)     # (nb, H, block, e)
    bb = jnp.pad(bias, ((0, pad), (0, 0))).reshape(nb, block, n)
    out = jax.lax.map(lambda qb_b: dense_softmax_mix(lp, qb_b[0], k, v, qb_b[1]), (qb, bb))   # (nb, H, block, e)
    return out.swapaxes(0, 1).reshape(H, nb * block, e)[:, :n]


MAX_UNROLLED = 32
"""The most query blocks :func:`query_blocked_mix` unrolls (4,096 tokens in blocks of 128)."""


def qkv_rows(W_q, W_k, W_v):
    """The rows of W_q, W_k, W_v stacked: "float[(H+2G)e d]" for one layer ("float[U (H+2G)e d]"
    stacked), so that X @ rows^T is the fused projection without a transposed copy."""
    flat = lambda a: a.reshape(a.shape[:-3] + (-1, a.shape[-1]))
    return jnp.concatenate([flat(a) for a in (W_q, W_k, W_v)], axis=-2)


def softmax_qkv(lp, X, positions=None, qkv=None):
    """Head-major q "float[H n e]" and k, v "float[G n e]" of one layer from one fused
    projection X @ qkv (made head-major by one transpose of all three), with the q/k
    biases, then the per-head q/k norm (over e, of the config's norm kind, when the layer has
    one), then RoPE."""
    cfg = lp.config
    if lp.W_q is None or lp.W_k is None:
        raise ValueError("softmax attention needs W_q and W_k, and this system has none: "
                         "use attention='uniform' or 'identity'")
    n = X.shape[0]
    H, G, e = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    if qkv is None:
        # no prebuilt weight (weights traced by the caller's jit or grad): this layer's rows, X @ W^T.
        # Building the (d, out) copy of every layer inside the program instead cost MiniLM's
        # gradient through 6 layers (benchmarks/vs_torch.py's C) two transposing copies of 9 MB
        Z = X @ qkv_rows(lp.W_q, lp.W_k, lp.W_v).T
    else:
        Z = X @ qkv                                                     # (n, (H + 2G) e)
    Z = jnp.swapaxes(Z.reshape(n, H + 2 * G, e), 0, 1)                  # (H + 2G, n, e)
    q, k, v = Z[:H], Z[H:H + G], Z[H + G:]
    if lp.b_q is not None:
        q = q + lp.b_q[:, None]
    if lp.b_k is not None:
        k = k + lp.b_k[:, None]
    if lp.q_norm_scale is not None:                  # the config's norm kind: RMSNorm, or Phi's LayerNorm
        q = apply_norm(cfg.norm, q, lp.q_norm_scale, lp.q_norm_bias, cfg.norm_eps)
    if lp.k_norm_scale is not None:
        k = apply_norm(cfg.norm, k, lp.k_norm_scale, lp.k_norm_bias, cfg.norm_eps)
    if cfg.rope_theta is not None:
        if positions is None:
            positions = jnp.arange(n)
        theta = cfg.rope_theta if lp.rope_base is None else lp.rope_base
        q, k = (apply_rope(t, positions, theta, cfg.rope_dim) for t in (q, k))
    return q, k, v




def softmax_attention_mix(lp, X, valid, positions=None, qkv=None, *, attention_block=None):
    """M "float[n H e]" with M[i, h] = sum_j A_h[i, j] V_g(h) x_j for softmax attention.

    ``qkv``: the fused weight of :func:`~powerlens._src.dynamics.projections.qkv_weight`, precomputed
    by loops that reuse it.
    q, k, v are made head-major "float[H n e]" (the layout XLA runs fastest: an einsum over
    the token-major arrays inserts a transpose per operand, and was 17 % slower for one MiniLM
    layer at 8 x 128 tokens; :func:`softmax_qkv`); query blocks keep grouped-query
    keys and values as their G heads, the other schedules repeat them to H), then, by
    ``attention_block`` (the run's :attr:`~powerlens._src.dynamics.options.Dynamics.attention_block`;
    the numbers are the same to float rounding):

      None (default)  one dense block (:func:`dense_softmax_mix`) up to :attr:`~powerlens._src.dynamics.execution.Tuning.blocked_above`
                      tokens, query blocks of :attr:`~powerlens._src.dynamics.execution.Tuning.query_block` above (:func:`query_blocked_mix`);
      0               one dense block, the whole "float[H n n]" score tensor;
      k > 0           the online softmax over blocks of k keys of
                      :func:`powerlens._src.dynamics.blocked.blocked_attention_mix`, "float[H n k]" at a time;
      "cudnn"         cuDNN's fused flash attention (:func:`fused_attention_mix`), where it
                      applies (:func:`check_fused_attention`: an NVIDIA GPU, a float16 or
                      bfloat16 system).
    """
    return softmax_mix(lp, *softmax_qkv(lp, X, positions, qkv), valid, attention_block=attention_block)


def softmax_mix(lp, q, k, v, valid, *, attention_block=None):
    """M "float[n H e]" of :func:`softmax_attention_mix` from head-major q "float[H n e]" and
    k, v "float[G n e]" already formed (:func:`softmax_qkv`), scheduled by ``attention_block``
    as that function says."""
    n, setting, r = q.shape[1], attention_block, lp.config.kv_group
    if setting == FUSED_ATTENTION:                                      # cuDNN's fused kernel
        check_fused_attention(lp, q.dtype)
        return fused_attention_mix(lp, *(jnp.swapaxes(t, 0, 1) for t in (q, k, v)), valid)
    tuning = execution.TUNING
    qblock = tuning.query_block if setting is None and n > tuning.blocked_above else n
    if r > 1 and (setting or qblock == n):
        # key blocks, and one dense block, read the keys and values repeated to the H query heads:
        # dense, that was faster than grouped matmuls (SmolLM2's 9 heads over 3, 8 x 128 tokens:
        # 3.3 ms against 4.6-6.2 ms); query blocks read them grouped (8 x 512: 42 ms against 76 ms)
        k, v = (jnp.repeat(t, r, axis=0) for t in (k, v))
    if setting:                                                         # k > 0: key blocks
        q, k, v = (jnp.swapaxes(t, 0, 1) for t in (q, k, v))            # token-major (n, H, e)
        return blocked_attention_mix(q, k, v, valid, scale=lp.scale, causal=lp.config.causal, window=lp.window,
                                     cap=lp.config.attn_softcap, block=int(setting))
    return jnp.swapaxes(query_blocked_mix(lp, q, k, v, valid, qblock), 0, 1)


def check_fused_attention(lp, dtype, backend=None):
    """A one-line ValueError naming what keeps cuDNN's fused attention
    (``attention_block="cudnn"``) from this layer, or nothing: it needs JAX's GPU backend
    (``backend``, default ``jax.default_backend()``), a float16 or bfloat16 system (cuDNN has
    no float32 attention kernel; powerlens loads float32), no attention-logit soft-cap
    (Gemma 2), and head dims that are multiples of 8 up to 256 (cuDNN itself allows 128 before
    Hopper, and says so when it is called)."""
    where = "Dynamics.attention_block='cudnn'"
    backend = jax.default_backend() if backend is None else backend
    if backend != "gpu":
        raise ValueError(f"{where} needs an NVIDIA GPU (cuDNN); JAX's backend here is {backend!r}: "
                         "leave attention_block None")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"{where} needs a float16 or bfloat16 system (cuDNN has no float32 attention); this "
                         f"system is {jnp.dtype(dtype).name}: cast its layers first, or leave attention_block None")
    if lp.config.attn_softcap is not None:
        raise ValueError(f"{where}: cuDNN has no attention-logit soft-cap, and this layer has "
                         f"attn_softcap={lp.config.attn_softcap}")
    e = lp.config.d_head
    if e % 8 or e > 256:
        raise ValueError(f"{where} needs a head dim that is a multiple of 8 and at most 256, got d_head={e}")


def fused_attention_mix(lp, q, k, v, valid, *, implementation: str = FUSED_ATTENTION):
    """M "float[n H e]" of token-major q "float[n H e]", k, v "float[n G e]" by one
    ``jax.nn.dot_product_attention`` call: cuDNN's fused flash attention on a GPU
    (``implementation="cudnn"``; ``"xla"`` makes the same call through XLA, which is how the
    tests check its arguments on a CPU). The query heads of a group read their G key/value
    heads as they are. The mask is :func:`key_bias` (causal, local window, padding keys) as
    an additive bias "float[1 1 n n]"; q is multiplied by the layer's scale beforehand, since
    the call takes its scale as a Python number and the layer's is an array (one per layer,
    traced in the scan). No soft-cap (:func:`check_fused_attention`)."""
    bias = key_bias(q.shape[0], valid, causal=lp.config.causal, window=lp.window, dtype=q.dtype)
    return jax.nn.dot_product_attention(q * jnp.asarray(lp.scale, q.dtype), k, v, bias=bias[None, None],
                                        scale=1.0, implementation=implementation)


def uniform_weights(n: int, valid, causal: bool, dtype=jnp.float32):
    """Uniform attention "float[n n]": mean over the valid (and, if causal, earlier) tokens."""
    ok = allowed_keys(n, valid, causal=causal).astype(dtype)
    return ok / jnp.maximum(ok.sum(-1, keepdims=True), 1)


def attention_weights(lp, X, valid, mode: str):
    """A "float[n n]" of the head-independent modes ``uniform`` and ``identity`` (softmax
    weights differ per head and are formed inside :func:`softmax_attention_mix`)."""
    n = X.shape[0]
    if mode == "uniform":
        return uniform_weights(n, valid, lp.config.causal, X.dtype)
    if mode == "identity":
        return jnp.eye(n, dtype=X.dtype)
    raise ValueError(f"attention_weights takes 'uniform' or 'identity', got {mode!r}")
