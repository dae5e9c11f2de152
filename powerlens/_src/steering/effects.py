"""What steering does to a model's outputs, and the activation-addition baseline.

All runs use the model's own forward pass (rule ``full``, FFN included), with the steered
unique layer's W_o replaced by W_o + delta_O.

Three conditions are compared on the same prompts:

    before               the unmodified model
    rank1                W_o[l] <- W_o[l] + delta_O (closed form or gradient result)
    activation_addition  h <- h + beta u added to the residual stream at the output of the
                         step that applies layer l (its last application), the usual
                         steering-vector recipe

Equal-norm comparison. Let Y (tokens leaving that step, unsteered) and Y' (the same with
the rank-1 change). The size of the rank-1 change is

    Delta = mean over valid tokens of ||Y'_i - Y_i||_2,

and activation addition changes every token of that output by exactly beta u with
||beta u|| = beta, so beta = Delta makes the two changes equal in mean norm.

Measures (per condition):

    alignment        mean over valid final tokens of cos(h_i, u)  (last hidden state,
                     before the final norm)
    pooled_cos       cos(mean over valid tokens of h_i, u), per prompt (the
                     sentence-embedding view of an encoder such as MiniLM)
    paper_rule_alignment   (before and rank1 only) mean / min cos(y_i, u) of the final
                     tokens of the ``paper`` dynamics, the quantity the closed form and the
                     optimiser control
    decoders only:   top-k next tokens at each prompt's last valid token (id, string,
                     probability), the probability of the target token, and the perplexity
                     exp(mean NLL of token t+1 given tokens <= t) on neutral sentences.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..dynamics.options import Dynamics
from ..dynamics.run import run_batch
from .directions import as_direction
from .rank1 import layer_index, steer_layers

NEUTRAL_SENTENCES = ("The weather was mild and the streets were quiet.",
                     "He read the report twice before he signed it.",
                     "Trains leave the station every twenty minutes.")
"""Neutral sentences for the perplexity cost of :func:`output_effects` (``neutral=``):
``powerlens steer`` reads all three, ``powerlens reproduce`` the first two."""


def steered_model(model, delta_O, layer: int = -1):
    """The model with W_o[layer] += delta_O (d, H e)."""
    return model.replace(layers=steer_layers(model.layers, delta_O, layer))


def _run(layers, schedule, X, valid, rule="full"):
    """The tokens "float[B n d]" after the steps ``schedule`` (a Schedule or tuple of unique layers) from X."""
    if not schedule:
        return X
    return run_batch(layers, X, valid, dynamics=Dynamics(rule=rule), schedule=np.asarray(schedule),
                     observe=("final",))["final"]


def final_cos(layers, x0, valid, u) -> np.ndarray:
    """cos(y_i, u) of every valid final token of the ``paper`` dynamics (flat array)."""
    Y = np.asarray(_run(layers, layers.schedule, jnp.asarray(x0, layers.dtype), valid, "paper"), np.float64)
    cos = (Y @ u) / np.linalg.norm(Y, axis=-1)
    return cos[np.asarray(valid, bool)]


def paper_alignment(layers, x0, valid, u) -> dict:
    """cos(y_i, u) of the final tokens of the ``paper`` dynamics (the rule the closed form and
    the optimiser target): mean and min over valid tokens, signed and sign-free."""
    cos = final_cos(layers, x0, valid, u)
    a = np.abs(cos)
    return {"mean": float(cos.mean()), "min": float(cos.min()), "abs_mean": float(a.mean()),
            "abs_min": float(a.min())}


def last_step(layers, layer: int) -> int:
    """The last schedule step that applies unique layer ``layer``."""
    l = layer_index(layers, layer)
    steps = layers.schedule.steps_of(l)               # a range for a compact schedule
    if not steps:
        raise ValueError(f"unique layer {l} is never applied by the schedule {layers.schedule}")
    return steps[-1]


def forward_final(model, x0, valid, *, layer: int = -1, add=None):
    """(final hidden state (B, n, d), output of the steered step (B, n, d)) under rule ``full``.

    ``add`` (d,): a vector added to every token of that step's output (activation addition)."""
    layers = model.layers
    sched = layers.schedule
    t = last_step(layers, layer)
    X = jnp.asarray(x0, layers.dtype)
    Y = _run(layers, sched[: t + 1], X, valid)
    if add is not None:
        Y = Y + jnp.asarray(add, Y.dtype)
    return _run(layers, sched[t + 1:], Y, valid), Y


def _cos_stats(h, valid, u):
    h = np.asarray(h, np.float64)
    v = np.asarray(valid, bool)
    cos = (h @ u) / np.linalg.norm(h, axis=-1)
    pooled = (h * v[..., None]).sum(1) / v.sum(1, keepdims=True)
    pooled_cos = pooled @ u / np.linalg.norm(pooled, axis=-1)
    return {"alignment": float(cos[v].mean()), "abs_alignment": float(np.abs(cos[v]).mean()),
            "alignment_per_token": [c[m].tolist() for c, m in zip(cos, v)],
            "pooled_cos": pooled_cos.tolist(), "pooled_cos_mean": float(pooled_cos.mean())}


def _top_k(model, logits, p, k: int) -> list:
    """The k most probable next tokens of each prompt (logits "float[B V]", their probabilities
    p), as JSON rows {id, token, prob} (:func:`~powerlens._src.models.tokens.top_tokens`); a model
    without a tokenizer names its tokens by their ids."""
    from ..models.tokens import top_tokens
    if model.info is not None and model.info.tokenizer is not None:
        return [[{"id": t.id, "token": t.text, "prob": t.prob} for t in row] for row in top_tokens(model, logits, k)]
    return [[{"id": int(i), "token": str(int(i)), "prob": float(row[i])} for i in np.argsort(-row)[:k]] for row in p]


def _log_softmax(logits):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1), np.float64)


def next_token_stats(model, h, valid, *, target_id: Optional[int] = None, k: int = 5):
    """Top-k next tokens and the target probability at each prompt's last valid token."""
    from ..models.forward import logits as model_logits
    v = np.asarray(valid, bool)
    last = v.shape[1] - 1 - np.argmax(v[:, ::-1], axis=1)
    hl = jnp.asarray(h)[jnp.arange(h.shape[0]), jnp.asarray(last)]          # (B, d)
    lg = model_logits(model, hl)                                           # (B, V)
    p = np.exp(_log_softmax(lg))
    out = {"topk": _top_k(model, lg, p, k), "target_prob": None}
    if target_id is not None:
        out["target_prob"] = p[:, int(target_id)].tolist()
        out["target_prob_mean"] = float(p[:, int(target_id)].mean())
    return out


@jax.jit
def _next_token_logp(logits, ids):
    """log p(id_{t+1} | ids_{<= t}) "float[B n-1]" from logits "float[B n V]" (float32 log-softmax;
    only the (B, n-1) numbers leave the device, never the (B, n, V) probabilities)."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]


def perplexity(model, ids, valid, h) -> float:
    """exp(mean over valid pairs (t, t+1) of -log p(id_{t+1} | ids_{<= t})) from final states h."""
    from ..models.forward import logits as model_logits
    ids = np.asarray(ids)
    v = np.asarray(valid, bool)
    pair = v[:, 1:] & v[:, :-1]
    if not pair.any():
        raise ValueError("perplexity needs sentences of at least two tokens")
    nxt = np.asarray(_next_token_logp(model_logits(model, jnp.asarray(h)), jnp.asarray(ids, jnp.int32)), np.float64)
    return float(np.exp(-nxt[pair].mean()))


def output_effects(model, u, delta_O, prompts, *, layer: int = -1, target_id: Optional[int] = None,
                   k: int = 5, neutral: Optional[Sequence] = None) -> dict:
    """Before / rank-1 / activation-addition effects on the model's outputs (module docstring).

    Args:
      model: a loaded :class:`~powerlens._src.models.base.Model`.
      u: steering direction (d,) (normalised here).
      delta_O: the rank-1 (or low-rank) change of W_o[layer], (d, H e); or a mapping
        name -> change, to compare several changes: the result is then name -> effects, and
        the unmodified model ("before") is run once for all of them.
      prompts: texts or token-id lists.
      target_id: decoders: the token whose probability is reported.
      neutral: decoders: sentences (texts or ids) for the perplexity cost. They are run in the
        same batch as the prompts (right-padded together: causal attention and the padding
        mask keep every valid token as it is alone).
    Returns a JSON-ready dict (one per change for a mapping).
    """
    from ..models.embed import embed_ids, padded_ids, prompt_ids
    d = model.layers.config.d_model
    u = as_direction(u, d)
    deltas = dict(delta_O) if isinstance(delta_O, Mapping) else {None: delta_O}
    decoder = bool(model.info is not None and model.info.decoder)
    rows = prompt_ids(model, prompts)
    B = len(rows)
    has_neutral = decoder and neutral is not None
    if has_neutral:
        rows += prompt_ids(model, neutral)
    ids, valid = padded_ids(model, rows)
    x0, vj = embed_ids(model, ids, valid)
    v = np.asarray(valid, bool)
    n_p = max(len(r) for r in rows[:B])                # the prompts' own padding (right-padded)
    prompt_x0, prompt_v = x0[:B, :n_p], vj[:B, :n_p]
    cond = lambda m, h: _condition(m, h, ids, v, B, u, decoder, has_neutral, target_id, k)
    h0, Y0 = forward_final(model, x0, vj, layer=layer)
    before = cond(model, h0)
    before_paper = paper_alignment(model.layers, prompt_x0, prompt_v, u)
    out = {}
    for name, delta in deltas.items():
        steered = steered_model(model, delta, layer)
        h1, Y1 = forward_final(steered, x0, vj, layer=layer)
        change = np.linalg.norm(np.asarray(Y1[:B], np.float64) - np.asarray(Y0[:B], np.float64), axis=-1)
        beta = float(change[v[:B]].mean())
        h2, _ = forward_final(model, x0, vj, layer=layer, add=beta * u)
        out[name] = {"layer": layer_index(model.layers, layer), "step": last_step(model.layers, layer),
                     "layer_output_change": beta, "beta": beta, "delta_norm": float(np.linalg.norm(np.asarray(delta))),
                     "decoder": decoder,
                     "conditions": {"before": before, "rank1": cond(steered, h1), "activation_addition": cond(model, h2)},
                     "paper_rule_alignment": {"before": before_paper,
                                              "rank1": paper_alignment(steered.layers, prompt_x0, prompt_v, u)}}
    return out if isinstance(delta_O, Mapping) else out[None]


def _condition(model, h, ids, valid, B, u, decoder, has_neutral, target_id, k) -> dict:
    """The measures of one condition: rows :B of the batch are the prompts, the rest the
    neutral sentences (decoders)."""
    res = _cos_stats(h[:B], valid[:B], u)
    if decoder:
        res.update(next_token_stats(model, h[:B], valid[:B], target_id=target_id, k=k))
        if has_neutral:
            res["perplexity"] = perplexity(model, ids[B:], valid[B:], h[B:])
    return res
