"""Softmax attention with an online softmax over key blocks: O(n * block) memory per head.

For one prompt, q "float[n H e]", k and v "float[n H e]" (key/value heads already repeated to
the H query heads), the mix is the one of the dense path::

    M[i, h] = sum_j A_h[i, j] v[j, h],   A_h = softmax_j(s_h[i, j] + mask[i, j]),
    s_h[i, j] = cap * tanh(scale q_ih . k_jh / cap)   (cap None: scale q_ih . k_jh)

computed block by block over the keys j (Milakov & Gimelshein's online softmax, the scheme
of flash attention): for each block b of keys, with the running maximum m, normaliser l and
unnormalised output o of each (h, i)::

    m' = max(m, max_{j in b} s_ij)      c = exp(m - m')
    l' = c l + sum_{j in b} exp(s_ij - m')
    o' = c o + sum_{j in b} exp(s_ij - m') v_j            M = o / l at the end.

Masked keys (padding, the causal mask, a local window) get weight exactly 0, as in the
dense path; a query with no allowed key (never the case for a valid token, which sees
itself) gets M = 0 rather than NaN. The score tensor is never formed whole: the scan holds
"float[H n block]" at a time, so memory no longer grows as n^2. Inside ``jit``, ``vmap`` and
the layer scan of :func:`powerlens._src.dynamics.run`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

DEFAULT_BLOCK = 256


def blocked_attention_mix(q, k, v, valid, *, scale, causal: bool, window=0, cap=None,
                          block: int = DEFAULT_BLOCK):
    """M "float[n H e]" of softmax attention by key blocks of ``block`` (see module docstring).

    Args:
      q, k, v: "float[n H e]" queries (RoPE applied), keys and values per query head.
      valid: "bool[n]" key padding mask (False: never attended to).
      scale: the softmax scale (a scalar, may be traced).
      causal: token i sees keys j <= i only.
      window: local window (i - window < j <= i, or |i - j| < window when not causal); 0 = none.
      cap: attention-logit soft-capping (Gemma 2), or None.
      block: keys per block (static); n is padded up to a multiple of it.
    """
    n, H, e = q.shape
    block = int(max(1, min(block, n)))
    nb = -(-n // block)
    pad = nb * block - n
    if pad:
        k = jnp.pad(k, ((0, pad), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, pad), (0, 0), (0, 0)))
        valid = jnp.pad(valid, (0, pad))
    kb = k.reshape(nb, block, H, e)
    vb = v.reshape(nb, block, H, e)
    okb = valid.reshape(nb, block)
    qs = jnp.swapaxes(q, 0, 1) * jnp.asarray(scale, q.dtype)             # (H, n, e)
    i = jnp.arange(n)[:, None]
    neg = jnp.asarray(-jnp.inf, q.dtype)

    def step(carry, blk):
        m, l, o = carry
        kj, vj, okj, start = blk
        s = jnp.einsum("hie,jhe->hij", qs, kj)                            # (H, n, block)
        if cap is not None:
            s = cap * jnp.tanh(s / cap)
        j = start + jnp.arange(block)[None, :]
        ok = jnp.broadcast_to(okj[None, :], (n, block))
        if causal:
            ok = ok & (j <= i) & ((window <= 0) | (j > i - window))
        else:
            ok = ok & ((window <= 0) | (jnp.abs(i - j) < window))
        s = jnp.where(ok[None], s, neg)
        m_new = jnp.maximum(m, s.max(-1))                                  # (H, n)
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        c = jnp.exp(jnp.where(jnp.isfinite(m), m - safe, neg))
        p = jnp.exp(s - safe[..., None])                                   # exactly 0 where masked
        l = c * l + p.sum(-1)
        o = c[..., None] * o + jnp.einsum("hij,jhe->hie", p, vj)
        return (m_new, l, o), None

    init = (jnp.full((H, n), neg), jnp.zeros((H, n), q.dtype), jnp.zeros((H, n, e), q.dtype))
    starts = jnp.arange(nb) * block
    (m, l, o), _ = jax.lax.scan(step, init, (kb, vb, okb, starts))
    M = o / jnp.where(l > 0, l, 1.0)[..., None]
    return jnp.swapaxes(M, 0, 1)                                           # (n, H, e)
