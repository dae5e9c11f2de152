"""Steering methods compared on equal terms, on the model's own outputs (design.md §4).

An edit of unique layer l is either a weight change ``{"delta_O": (d, H e)}`` (W_o[l] +=
delta_O) or an activation addition ``{"vector": (d,)}`` (v added to every token of the
output of the last step applying l). For each edit, on the model's forward pass (rule
``full``):

    target_prob, target_rank     p(target | prompt) and its rank (1 = the most probable) at
                                 each prompt's last valid token
    topk                         the 5 most probable next tokens (text)
    control_kl_mean              mean over control prompts of KL(p_base || p_edited), from the
                                 log-softmax in float64, reported as max(0, KL)
    delta_norm                   ||delta_O||_F or ||v||
    layer_output_change          beta = ||Y' - Y||_F over the valid tokens of all prompts, Y the
                                 output of the edited step: the common scale of the methods
    continuation                 the greedy continuation (12 tokens) of each prompt
    paraphrases                  target_prob on paraphrase prompts (generalisation)
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from .effects import forward_final, last_step, steered_model
from .rank1 import layer_index


def activation_model(model, vector, layer: int = -1):
    """The model whose edited block adds ``vector`` (d,) to its output at every token, as a
    change of the FFN output bias of that layer (exact for pre-norm blocks without a
    post-FFN norm: the block output is h + FFN(.) + b_out). Error where that is not exact."""
    layers = model.layers
    cfg = layers.config
    if cfg.norm_placement == "post" or getattr(layers, "post_ffn_norm_scale", None) is not None:
        family = getattr(model.info, "family", None) or "post-norm"
        raise ValueError(f"activation addition as a bias change is not exact for a {family} block "
                         f"(its output is normed after the FFN)")
    last_step(layers, layer)                      # the layer is applied by the schedule
    l = layer_index(layers, layer)
    base = layers.b_out if layers.b_out is not None else jnp.zeros((layers.n_unique, cfg.d_model), layers.W_v.dtype)
    return model.replace(layers=layers.replace(b_out=base.at[l].add(jnp.asarray(vector, base.dtype))))


def _edited(model, edit, layer):
    """(the model with a weight edit applied or the model itself, the vector to add or None)."""
    if "delta_O" in edit:
        return steered_model(model, np.asarray(edit["delta_O"]), layer), None
    return model, np.asarray(edit["vector"])


def last_logp(model, h, valid):
    """(logits "float[B V]", log p "float64[B V]") at each row's last valid token: the logits
    as the model computes them, the log-softmax on the host in float64 (so that p sums to 1 to
    float64 rounding and a KL of an unchanged distribution is 0, not -1e-8)."""
    from ..models.forward import logits
    v = np.asarray(valid, bool)
    last = v.shape[1] - 1 - np.argmax(v[:, ::-1], axis=1)
    lg = logits(model, jnp.asarray(h)[jnp.arange(h.shape[0]), jnp.asarray(last)])
    z = np.asarray(lg.astype(jnp.float32), np.float64)
    m = z.max(axis=-1, keepdims=True)
    logp = z - m - np.log(np.sum(np.exp(z - m), axis=-1, keepdims=True))
    return lg, logp


def _last_probs(model, h, valid):
    """(logits, p "float64[B V]") at each row's last valid token (:func:`last_logp`)."""
    lg, logp = last_logp(model, h, valid)
    return lg, np.exp(logp)


def kl_rows(logp, logq) -> np.ndarray:
    """KL(p || q) per row from log-probabilities "float64[M V]" (0 log 0 = 0), reported as
    max(0, KL): the exact KL is >= 0, a negative value is rounding."""
    logp, logq = np.asarray(logp, np.float64), np.asarray(logq, np.float64)
    p = np.exp(logp)
    kl = np.sum(np.where(p > 0, p * (logp - logq), 0.0), axis=-1)
    return np.maximum(kl, 0.0)


def _embed(model, texts):
    from ..models.embed import embed
    x0, valid = embed(model, list(texts))
    return jnp.asarray(x0), jnp.asarray(valid)


def edit_effects(model, prompts: Sequence[str], edits: Mapping[str, dict], *, target_id: Optional[int], layer: int = -1,
                 controls: Optional[Sequence[str]] = None, paraphrases: Optional[Sequence[str]] = None, k: int = 5,
                 continuation_tokens: int = 12) -> dict:
    """The measures of the module docstring for each edit, and for the model itself ("before").

    Returns {"before": {...}, name: {...}} (JSON-ready). ``continuation`` is left out (with
    ``continuation_unavailable`` saying why) for an activation addition on a block whose
    output is normed after its FFN; ``continuation_tokens=0`` leaves it out everywhere."""
    from ..models.generate import generate
    from ..models.tokens import top_tokens
    from .token import CONTROL_PROMPTS
    x0, valid = _embed(model, prompts)
    xc, vc = _embed(model, list(CONTROL_PROMPTS) if controls is None else controls)
    xp, vp = _embed(model, paraphrases) if paraphrases else (None, None)
    v = np.asarray(valid, bool)
    h0, Y0 = forward_final(model, x0, valid, layer=layer)
    _, lpc0 = last_logp(model, forward_final(model, xc, vc, layer=layer)[0], vc)
    Y0 = np.asarray(Y0, np.float64)

    def measure(m, add, name):
        h, Y = forward_final(m, x0, valid, layer=layer, add=add)
        lg, p = _last_probs(m, h, valid)
        out = {"topk": [[{"id": t.id, "token": t.text, "prob": t.prob} for t in row] for row in top_tokens(m, lg, k)]}
        if target_id is not None:
            pt = p[:, int(target_id)]
            out.update({"target_prob": pt.tolist(), "target_prob_mean": float(pt.mean()),
                        "target_rank": [int(1 + np.sum(row > row[int(target_id)])) for row in p]})
        _, lpc = last_logp(m, forward_final(m, xc, vc, layer=layer, add=add)[0], vc)
        out["control_kl_mean"] = float(kl_rows(lpc0, lpc).mean())
        out["layer_output_change"] = float(np.linalg.norm((np.asarray(Y, np.float64) - Y0)[v]))
        if xp is not None and target_id is not None:
            _, pp = _last_probs(m, forward_final(m, xp, vp, layer=layer, add=add)[0], vp)
            out["paraphrases"] = {"prompts": list(paraphrases), "target_prob": pp[:, int(target_id)].tolist(),
                                  "target_prob_mean": float(pp[:, int(target_id)].mean())}
        if not continuation_tokens:
            return out
        try:
            gm = m if add is None else activation_model(m, add, layer)
            out["continuation"] = generate(gm, list(prompts), max_new_tokens=continuation_tokens).text
        except ValueError as exc:
            out["continuation_unavailable"] = str(exc)
        return out

    res = {"before": {**measure(model, None, "before"), "delta_norm": 0.0}}
    for name, edit in edits.items():
        m, add = _edited(model, edit, layer)
        size = np.asarray(edit["delta_O"] if "delta_O" in edit else edit["vector"], np.float64)
        res[name] = {**measure(m, add, name), "delta_norm": float(np.linalg.norm(size)),
                     "edit": "weight" if "delta_O" in edit else "activation"}
    return res


def frontier_point(model, x0, valid, edit, *, target_id: int, layer: int = -1, with_min: bool = False):
    """(beta, mean target probability) of one edit on prompts x0 (see module docstring);
    ``with_min``: also the least target probability over the prompts."""
    _, Y0 = forward_final(model, x0, valid, layer=layer)
    m, add = _edited(model, edit, layer)
    h, Y = forward_final(m, x0, valid, layer=layer, add=add)
    _, p = _last_probs(m, h, valid)
    v = np.asarray(valid, bool)
    beta = float(np.linalg.norm((np.asarray(Y, np.float64) - np.asarray(Y0, np.float64))[v]))
    pt = p[:, int(target_id)]
    return (beta, float(pt.mean()), float(pt.min())) if with_min else (beta, float(pt.mean()))


def plot_frontier(curves: Mapping[str, Sequence], path, *, levels: Optional[Sequence[float]] = None,
                  title: Optional[str] = None):
    """Target probability against beta, one curve per method. ``curves``: name -> points
    (beta, p) or (beta, p, reached). A point that did not reach its level (``reached`` False)
    is left off the axes, which span only the points that did, and listed in a note under
    them (a failed edit can be orders of magnitude smaller and would stretch the beta axis)."""
    from matplotlib.figure import Figure
    from ..analysis.plots import save_figure
    fig = Figure(figsize=(7.0, 4.4))
    ax = fig.subplots()
    missed, plotted = [], False
    for i, (name, pts) in enumerate(curves.items()):
        pts = [tuple(q) + (True,) * (3 - len(q)) for q in pts]
        bad = [q for q in pts if not q[2]]
        if bad:
            ps = sorted(q[1] for q in bad if np.isfinite(q[1]))
            missed.append(f"{name}: {len(bad)} of {len(pts)} level(s) not reached"
                          + (f" (p mean {', '.join(f'{p:.3g}' for p in ps)})" if ps else ""))
        good = sorted((b, p) for b, p, ok in pts if ok and np.isfinite(b) and np.isfinite(p) and b > 0)
        if not good:
            continue
        b, p = zip(*good)
        ax.plot(b, p, marker="o", ms=5, lw=1.6, color=f"C{i}", label=name)
        plotted = True
    for lv in levels or ():
        ax.axhline(lv, color="0.6", ls=":", lw=0.8)
    if plotted:
        ax.set_xscale("log")
    ax.set_xlabel("β = ‖Δ edited layer output‖_F over the prompts' tokens")
    ax.set_ylabel("p(target | prompt), mean over prompts")
    ax.set_ylim(-0.02, 1.02)
    if plotted:
        ax.legend(fontsize=8, loc="best", framealpha=0.85)
    ax.grid(alpha=0.3, which="both")
    if title:
        ax.set_title(title, fontsize=11)
    if missed:
        fig.text(0.01, 0.01, "left out, target not reached: " + "; ".join(missed), fontsize=7, color="0.25",
                 ha="left", va="bottom", wrap=True)
        fig.tight_layout(rect=(0, 0.05 * len(missed), 1, 1))
    else:
        fig.tight_layout()
    return save_figure(fig, path)
