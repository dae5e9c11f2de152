"""``powerlens steer``: rank-1 steering of the last layer toward a direction u.

α comes from ``--alpha``, from ``--target-alignment c`` (the exact one-step relation of
the ``paper`` rule: the smallest α from which every token has |cos(x, u)| ≥ c after the
steered layer; the default, with c = 0.99), or ``--optimize`` learns a change ΔO of rank at
most ``--rank`` instead (optax: min ‖ΔO‖_F subject to the worst final alignment ≥ c; it has no
α, and is reported by its norm and rank beside the closed form at equal alignment). Alignment
is sign-free, as γ is.

The closed-form w (``--w``, default ``auto``) is ``inverse`` where the last layer's V_cat has
full column rank and ``value`` otherwise (every grouped-query model); the choice is printed
and recorded in steer.json as ``w``.
"""
from __future__ import annotations

import os

import numpy as np

from .. import io
from ..analysis import plots
from . import budget
from .simulate import settings_of

NEUTRAL = ["The weather was mild and the streets were quiet.",
           "He read the report twice before he signed it.",
           "Trains leave the station every twenty minutes."]


def check_steps(args) -> None:
    """``--steps``: None (the optimiser's default) or a positive integer."""
    if getattr(args, "steps", None) is not None and args.steps < 1:
        raise ValueError(f"--steps must be a positive integer, got {args.steps}")


def _system(args):
    """(layers, model or None, x0 (B, n, d), valid (B, n), texts)."""
    if args.model and args.weights:
        raise ValueError("give either MODEL or --weights, not both")
    if args.weights:
        from ..models.npz import load_weights_npz
        if not args.init:
            raise ValueError("--weights needs --init x0.npy (the initial tokens)")
        layers = load_weights_npz(args.weights)
        from .system import initial_tokens
        x0 = initial_tokens(args, layers.config.d_model)
        x0 = x0[None] if x0.ndim == 2 else x0
        return layers, None, x0, np.ones(x0.shape[:2], bool), None
    if not args.model:
        raise ValueError("give MODEL (a path, hub id, minilm, smollm2 or gemma3) or --weights system.npz --init x0.npy")
    from ..models import embed, load
    from .models import read_prompts
    texts = read_prompts(args)
    model = load(args.model, allow_download=getattr(args, "allow_download", False))
    x0, valid = embed(model, texts)
    return model.layers, model, np.asarray(x0), np.asarray(valid), texts


def _final_cos(layers, x0, valid, u):
    """Sign-free alignment |cos(x_i, u)| of every valid final token under the paper rule (flat array)."""
    from ..steering.effects import final_cos
    return np.abs(final_cos(layers, x0, valid, u))


def _topk_bars(model, delta, layer, x0, valid, target_id, k: int = 6):
    """Tokens (top-k before, top-k after, the target) and their probabilities for prompt 0."""
    import jax
    from ..models.forward import logits
    from ..models.tokens import token_texts
    from ..steering.effects import forward_final, steered_model
    v = np.asarray(valid, bool)[0]
    last = int(np.nonzero(v)[0][-1])
    probs = []
    for m in (model, steered_model(model, delta, layer)):
        h, _ = forward_final(m, x0[:1], valid[:1])
        probs.append(np.asarray(jax.nn.softmax(logits(m, h[:, last:last + 1])[0, 0]), np.float64))
    ids = list(dict.fromkeys(list(np.argsort(-probs[0])[:k]) + list(np.argsort(-probs[1])[:k])
                             + ([target_id] if target_id is not None else [])))
    labels = token_texts(model, ids)                                    # decode(model, [id]) of each
    return labels, [float(probs[0][i]) for i in ids], [float(probs[1][i]) for i in ids]


def cmd_steer(args) -> int:
    from ..steering import layer_w_choice, minimal_alpha, optimize_steering, output_effects, parse_direction, rank1
    from ..steering.alpha import check_target
    from ..steering.rank1 import check_alpha
    check_steps(args)
    if args.steps is not None and not args.optimize:
        raise ValueError("--steps sets the Adam steps of --optimize; give --optimize too")
    layers, model, x0, valid, texts = _system(args)
    budget.check(budget.run_estimate(**budget.shapes_of(layers), steps=len(layers.schedule), batch=x0.shape[0],
                                     tokens=x0.shape[1], gradients=args.optimize))
    if args.alpha is not None:
        check_alpha(args.alpha)
    target = check_target(args.target_alignment if args.target_alignment is not None else 0.99)
    if args.rank < 1:
        raise ValueError(f"--rank must be a positive integer, got {args.rank}")
    direction = parse_direction(args.direction, d=layers.config.d_model, model=model, seed=args.seed)
    u = direction.vector
    choice = layer_w_choice(layers, args.w)
    w = choice.kind
    doc = {"settings": {**settings_of(args), "versions": io.versions()}, "direction": direction.to_json(),
           "w": w, "w_choice": choice.to_json()}
    if args.optimize:
        opt = optimize_steering(layers, x0, u, valid=valid, target=target, reduce="min", param="lowrank",
                                rank=args.rank, w=w, seed=args.seed, signed=False, steps=args.steps)
        if not opt.feasible[0]:
            raise ValueError(f"--optimize found no change of rank <= {args.rank} reaching alignment {target} "
                             f"(the closed-form start reached {float(opt.closed_alignment[0]):.3g}); "
                             f"lower --target-alignment")
        delta = np.asarray(opt.delta_O[0])
        doc["optimize"] = opt.to_json(0)
        alpha = float(opt.closed_alpha[0])          # the closed form's, at the same alignment: the reference
        method = f"gradient, rank <= {args.rank}"
    else:
        if args.alpha is not None:
            alpha = float(args.alpha)
            method = "closed form, given alpha"
        else:
            m = minimal_alpha(layers, u, x0, valid=valid, target=target, w=w, signed=False)
            doc["minimal_alpha"] = m.to_json()
            alpha = m.alignment.alpha
            method = f"closed form, smallest alpha for alignment {target}"
        delta = None
    r1 = rank1(layers, u, alpha=alpha, w=w)
    if delta is None:
        delta = r1.delta_O
    delta_norm = float(np.linalg.norm(delta))
    doc.update({"method": method, "delta_norm": delta_norm})
    if args.optimize:      # a learned change has a norm and a rank, no alpha
        delta_rank = doc["optimize"]["delta_rank"]
        doc.update({"delta_rank": delta_rank, "closed_form_at_equal_alignment": r1.to_json()})
        size = f"||dO||_F={delta_norm:.4g} (rank {delta_rank})"
        size_title = f"‖ΔO‖_F={delta_norm:.3g}, rank {delta_rank}"
        reference = f"  closed form at equal alignment: alpha={alpha:.4g}  ||dO||_F={r1.delta_norm:.4g}"
    else:
        doc.update({"alpha": alpha, "delta_rank": 1, "rank1": r1.to_json()})
        size = f"alpha={alpha:.4g}  ||dO||_F={delta_norm:.4g}"
        size_title = f"α={alpha:.3g}"
        reference = None
    steered = layers.replace(W_o=layers.W_o.at[r1.layer].add(np.asarray(delta, np.asarray(layers.W_o).dtype)))
    before = _final_cos(layers, x0, valid, u)
    after = _final_cos(steered, x0, valid, u)
    doc["alignment"] = {"before": before.tolist(), "after": after.tolist(),
                        "mean_before": float(before.mean()), "mean_after": float(after.mean()),
                        "min_after": float(after.min())}
    # alignment against alpha (closed form, same w)
    grid = alpha * np.logspace(-2, 1, 13)
    curve_mean, curve_min = [], []
    for a in grid:
        c = _final_cos(rank1(layers, u, alpha=float(a), w=w, spectrum=False).layers, x0, valid, u)
        curve_mean.append(float(c.mean()))
        curve_min.append(float(c.min()))
    doc["alignment_vs_alpha"] = {"alpha": grid.tolist(), "mean": curve_mean, "min": curve_min}
    if model is not None:
        neutral = NEUTRAL if model.info.decoder else None
        doc["effects"] = output_effects(model, u, delta, texts, target_id=direction.token_id, neutral=neutral)
    with io.output_dir(args.out, command=args.command) as stage:
        io.write_json(os.path.join(stage, "steer.json"), doc)
        plots.plot_curve(grid, {"mean over tokens": np.array(curve_mean), "worst token": np.array(curve_min)},
                         os.path.join(stage, "alignment_vs_alpha.png"), xlabel="α", ylabel="|cos(x_final, u)|",
                         logx=True, hlines={"target": target}, title=f"Closed form: alignment against α ({direction.label})")
        plots.plot_histogram_before_after(before, after, os.path.join(stage, "alignment_hist.png"),
                                          xlabel="|cos(x_final, u)| (paper rule)", title=f"{method}: {size_title}")
        if model is not None and model.info.decoder:
            labels, pb, pa = _topk_bars(model, delta, r1.layer, x0, valid, direction.token_id)
            plots.plot_bars(labels, pb, pa, os.path.join(stage, "topk.png"),
                            title=f"Next token after the first prompt: before vs after steering toward {direction.label}")
    print(f"wrote {args.out}: steer.json and figures")
    print(f"  {choice.describe()}")
    print(f"  {method}: {size}  alignment mean {before.mean():.3f} -> {after.mean():.3f} (min {after.min():.3f})")
    if reference:
        print(reference)
    return 0
