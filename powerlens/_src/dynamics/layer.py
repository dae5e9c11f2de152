"""One layer of the token dynamics, for each rule of design.md §1.

    attn(X)_i = sum_h O_h V_h (A_h X)_i  (+ c = O b_v + b_o when ``keep_bias``)

    paper    X <- N2(X + attn(X))                   FFN dropped, c dropped by default
    post_ln  X <- LN(X + attn(X))                   BERT/ALBERT attention sub-layer
    pre_ln   X <- X + attn(LN(X))                   GPT-2/GPT-Neo/Llama attention sub-layer
    full     the model's own block, FFN included (post: LN2(h + FFN(h)), h = LN1(X + attn X);
             pre: h + FFN(LN2 h), h = X + attn(LN1 X); parallel pre (GPT-NeoX, Phi):
             X + attn(LN1 X) + FFN(LN2 X), LN2 = LN1 when the layer has no ffn_norm)

Sandwich norms (Gemma 2/3: ``post_attn_norm_scale``, ``post_ffn_norm_scale``) norm each
sub-layer's output before it joins the residual: the attention sub-layer of ``pre_ln`` and
``full`` is X + PostNorm(attn(PreNorm X)), the FFN sub-layer of ``full``
h + PostFFNNorm(FFN(PreFFNNorm h)). ``paper`` and ``post_ln`` drop them with every other norm.

Every function takes one unique layer's parameters ``lp`` (leading axis removed) and
one prompt X (n, d) with its ``valid`` mask (n,).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .attention import attention_weights, check_attention, softmax_attention_mix
from .norms import apply_norm, l2_normalize
from .params import Layer
from .projections import Projections
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Real

RULES = ("paper", "post_ln", "pre_ln", "full")


def check_rule(rule: str) -> str:
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; expected one of {RULES}")
    return rule


def default_keep_bias(rule: str) -> bool:
    """The constant c = O b_v + b_o is dropped by the ``paper`` rule, kept by the others."""
    return rule != "paper"


def attention_output(lp: Layer, X: Real[ArrayLike, "n d"], valid: Bool[ArrayLike, "n"], *,
                     attention: str = "softmax", keep_bias: bool = False,
                     positions: Int[ArrayLike, "n"] | None = None,
                     projections: Projections | None = None,
                     attention_block: int | str | None = None) -> Float[Array, "n d"]:
    """attn(X) of one layer: "float[n d]".

    Values are formed first (V_g X per key/value head), mixed by A, concatenated over
    heads and projected by W_o, so the cost is that of a standard attention layer. For
    softmax attention q, k and v come from one fused projection. ``projections``: this
    layer's (in, out) copies of W_q, W_k, W_v (fused) and W_o
    (:class:`~powerlens._src.dynamics.projections.Projections`: a plain X @ W each); without them
    the layer's own rows are read in place, X @ W^T. ``attention_block``: how softmax
    attention is computed (the run's ``Dynamics.attention_block``;
    :func:`~powerlens._src.dynamics.attention.softmax_attention_mix`).
    """
    cfg = lp.config
    n = X.shape[0]
    P = Projections() if projections is None else projections
    if attention == "softmax":
        M = softmax_attention_mix(lp, X, valid, positions, P.qkv, attention_block=attention_block)   # (n, H, e)
    else:
        A = attention_weights(lp, X, valid, attention)                 # (n, n), shared by all heads
        V = X @ lp.W_v.reshape(-1, X.shape[-1]).T                      # (n, G e)
        M = (A @ V).reshape(n, cfg.n_kv_heads, cfg.d_head)
        if cfg.kv_group > 1:
            M = jnp.repeat(M, cfg.kv_group, axis=1)                    # (n, H, e)
    return head_output(lp, M.reshape(n, -1), keep_bias=keep_bias, out=P.out)


def head_output(lp: Layer, M: Float[ArrayLike, "*batch He"], *, keep_bias: bool = False,
                out: Float[ArrayLike, "He d"] | None = None) -> Float[Array, "*batch d"]:
    """The heads' mixed values M (concatenated over heads) projected by W_o: M W_o^T, plus
    c = O b_v + b_o when ``keep_bias``. ``out``: the (in, out) copy W_o^T, when prepared
    (:class:`~powerlens._src.dynamics.projections.Projections`); else W_o's rows are read in place."""
    cfg = lp.config
    y = M @ lp.W_o.T if out is None else M @ out
    if keep_bias:
        if lp.b_v is not None:
            b_v = jnp.repeat(lp.b_v, cfg.kv_group, axis=0).reshape(-1)
            y = y + lp.W_o @ b_v
        if lp.b_o is not None:
            y = y + lp.b_o
    return y


def norm_of(lp, X, which: str):
    """The layer's norm ``which`` (``norm``, ``ffn_norm``, ``post_attn_norm``, ``post_ffn_norm``) of
    X "float[n d]": its norms part's ``{which}_scale`` and ``{which}_bias`` with the config's kind and eps."""
    cfg = lp.config
    scale = getattr(lp.norms, f"{which}_scale")
    bias = getattr(lp.norms, f"{which}_bias", None)
    return apply_norm(cfg.norm, X, scale, bias, cfg.norm_eps)


def _post(lp, Y, which: str):
    """The sandwich post-norm ``which`` (``post_attn_norm``, ``post_ffn_norm``) of Y, when the layer has it."""
    return Y if getattr(lp.norms, f"{which}_scale") is None else norm_of(lp, Y, which)


def ffn(lp: Layer, X: Float[ArrayLike, "*batch d"]) -> Float[Array, "*batch d"]:
    """The block's feed-forward network "float[n d]" -> "float[n d]": W_out act(W_in x + b_in) + b_out
    (gated: act(W_gate x) * (W_in x + b_in)), from the layer's FFN part."""
    act, p = lp.config.ffn_activation, lp.ffn
    if p is None or act is None:
        raise ValueError("rule 'full' needs FFN parameters (W_in, W_out and ffn_activation); "
                         "this system has none: load it from a checkpoint, with every part (parts='all')")
    h = X @ p.W_in.T
    if p.b_in is not None:
        h = h + p.b_in
    if act == "gelu":
        h = jax.nn.gelu(h, approximate=False)
    elif act == "gelu_new":
        h = jax.nn.gelu(h, approximate=True)
    elif act == "relu":
        h = jax.nn.relu(h)
    elif act in ("silu_glu", "gelu_glu"):
        g = X @ p.W_gate.T
        h = (jax.nn.silu(g) if act == "silu_glu" else jax.nn.gelu(g, approximate=True)) * h
    out = h @ p.W_out.T
    if p.b_out is not None:
        out = out + p.b_out
    return out


def layer_step(lp: Layer, X: Real[ArrayLike, "n d"], valid: Bool[ArrayLike, "n"], *, rule: str = "paper",
               attention: str = "softmax", keep_bias: bool | None = None,
               positions: Int[ArrayLike, "n"] | None = None,
               projections: Projections | None = None,
               attention_block: int | str | None = None) -> Float[Array, "n d"]:
    """Apply one layer under ``rule``: "float[n d]" -> "float[n d]". ``projections``: this
    layer's (in, out) attention weight copies, when prepared; ``attention_block``: how softmax
    attention is computed (both: see :func:`attention_output`)."""
    check_rule(rule)
    check_attention(attention)
    if keep_bias is None:
        keep_bias = default_keep_bias(rule)
    kw = dict(attention=attention, keep_bias=keep_bias, positions=positions, projections=projections,
              attention_block=attention_block)
    if rule == "paper":
        return l2_normalize(X + attention_output(lp, X, valid, **kw))
    if rule == "post_ln":
        return norm_of(lp, X + attention_output(lp, X, valid, **kw), "norm")
    if rule == "pre_ln":
        return X + _post(lp, attention_output(lp, norm_of(lp, X, "norm"), valid, **kw), "post_attn_norm")
    # full
    return full_block(lp, X, attention_output(lp, full_attention_input(lp, X), valid, **kw))


def full_attention_input(lp: Layer, X: Real[ArrayLike, "*batch d"]) -> Real[ArrayLike, "*batch d"]:
    """What rule ``full``'s attention reads: X (post norm) or LN1 X (pre norm)."""
    return X if lp.config.norm_placement == "post" else norm_of(lp, X, "norm")


def full_block(lp: Layer, X: Real[ArrayLike, "*batch d"],
               attn: Float[ArrayLike, "*batch d"]) -> Float[Array, "*batch d"]:
    """Rule ``full``'s block token by token, given its attention output attn = attn(X) (post
    norm) or attn(LN1 X) (pre norm; see :func:`layer_step`): residuals, norms and FFN, any
    leading axes (the steering objectives evaluate it at a prompt's last token only)."""
    if lp.config.norm_placement == "post":
        h = norm_of(lp, X + attn, "norm")
        return norm_of(lp, h + ffn(lp, h), "ffn_norm")
    if lp.config.parallel_residual:     # GPT-NeoX / Phi: both sub-layers read X
        Xf = norm_of(lp, X, "norm" if lp.norms.ffn_norm_scale is None else "ffn_norm")
        return X + attn + ffn(lp, Xf)
    h = X + _post(lp, attn, "post_attn_norm")
    return h + _post(lp, ffn(lp, norm_of(lp, h, "ffn_norm")), "post_ffn_norm")


def faithful_rule(config) -> str:
    """The attention-only rule that matches how the model runs (``post_ln`` or ``pre_ln``)."""
    return "post_ln" if config.norm_placement == "post" else "pre_ln"
