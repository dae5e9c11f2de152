"""``powerlens steer MODEL --objective token``: make a token the model's own next token.

Four methods edit one layer (``--layer``, default the last) and are compared on the model's
forward pass (rule ``full``, :mod:`powerlens.steering.compare`):

    closed_form_paper_alpha   O += alpha u w^T at the paper rule's alpha (alignment
                              ``--target-alignment``, default 0.99)
    closed_form_token_alpha   the same ray, alpha chosen so that every prompt reaches ``--target-prob``
    gradient                  a learned dO of rank <= ``--rank``: min ||dO||_F subject to
                              p(token) >= ``--target-prob`` at every prompt and mean control
                              KL <= ``--max-kl`` (optax, augmented Lagrangian, ``--steps``
                              Adam steps, default 300)
    activation_addition       the same problem over a vector v added to the layer's output

The folder gets steer.json (``effects.conditions.<method>``), delta_O.npy (the learned dO,
(d, H e)) and frontier.png (target probability against beta, the change of the layer's
output, over several levels of ``--target-prob``).
"""
from __future__ import annotations

import os

import numpy as np

from .. import io
from . import budget
from .simulate import settings_of
from .steer import check_steps

FRONTIER_LEVELS = (0.1, 0.3, 0.5, 0.9)
DEFAULT_PARAPHRASES = {
    "The capital of France is": ("France's capital city is", "The capital city of France is",
                                 "The French capital is"),
}
METHODS = ("closed_form_paper_alpha", "closed_form_token_alpha", "gradient", "activation_addition")


def _lines(path: str, flag: str):
    from .models import read_prompts_file
    try:
        return read_prompts_file(path)
    except ValueError as exc:
        raise ValueError(str(exc).replace("--prompts", flag)) from None


def _paraphrases(args, texts):
    if args.paraphrases:
        return _lines(args.paraphrases, "--paraphrases")
    found = [p for t in texts for p in DEFAULT_PARAPHRASES.get(t.strip(), ())]
    return found or None


def _check(args):
    if args.weights or not args.model:
        raise ValueError("--objective token needs MODEL (a causal decoder: its LM head gives the next token)")
    if args.alpha is not None:
        raise ValueError("--objective token compares its own edits; --alpha cannot be combined with it")
    if not 0.0 < args.target_prob < 1.0:
        raise ValueError(f"--target-prob must lie strictly between 0 and 1, got {args.target_prob}")
    if not (np.isfinite(args.max_kl) and args.max_kl > 0):
        raise ValueError(f"--max-kl must be a finite number > 0, got {args.max_kl}")
    if args.rank < 1:
        raise ValueError(f"--rank must be a positive integer, got {args.rank}")
    check_steps(args)
    if not args.direction.startswith("token:"):
        raise ValueError(f"--objective token needs --direction token:WORD (the target token), got {args.direction!r}")


def cmd_steer_token(args) -> int:
    from ..models import embed, load
    from ..steering import CONTROL_PROMPTS, layer_w_choice, minimal_alpha, optimize_steering, parse_direction, rank1
    from ..steering.alpha import check_target
    from ..steering.compare import edit_effects, frontier_point, plot_frontier
    from ..steering.rank1 import layer_index
    from .models import read_prompts
    _check(args)
    target_alignment = check_target(args.target_alignment if args.target_alignment is not None else 0.99)
    texts = read_prompts(args)
    controls = _lines(args.controls, "--controls") if args.controls else None
    paraphrases = _paraphrases(args, texts)
    model = load(args.model, allow_download=getattr(args, "allow_download", False))
    if not model.info.decoder:
        raise ValueError(f"--objective token needs a causal decoder; {args.model!r} is a {model.info.family} encoder")
    layers = model.layers
    l = layer_index(layers, -1 if args.layer is None else args.layer)
    x0, valid = (np.asarray(a) for a in embed(model, texts))
    budget.check(budget.run_estimate(**budget.shapes_of(layers), steps=len(layers.schedule), batch=x0.shape[0],
                                     tokens=x0.shape[1], gradients=True))
    direction = parse_direction(args.direction, d=layers.config.d_model, model=model, seed=args.seed)
    u, tid = direction.vector, int(direction.token_id)
    choice = layer_w_choice(layers, args.w, l)
    levels = sorted(set(FRONTIER_LEVELS) | {float(args.target_prob)})
    main = levels.index(float(args.target_prob))
    common = dict(objective="token", valid=valid, layer=l, target_prob=levels, max_kl=args.max_kl,
                  controls=controls, seed=args.seed, w=choice.kind, steps=args.steps)
    grad = optimize_steering(model, x0, [tid] * len(levels), param="lowrank", rank=args.rank, **common)
    act = optimize_steering(model, x0, [tid] * len(levels), param="activation", **common)
    if not grad.feasible[main]:
        raise ValueError(f"--optimize found no change of rank <= {args.rank} of layer {l} with p({direction.token!r}) "
                         f">= {args.target_prob} at every prompt and control KL <= {args.max_kl}; lower "
                         f"--target-prob or raise --max-kl")
    ray = lambda alpha: rank1(layers, u, alpha=float(alpha), w=choice.kind, layer=l, spectrum=False).delta_O
    edits, notes = {}, {}
    try:
        paper_alpha = minimal_alpha(layers, u, x0, valid=valid, target=target_alignment, w=choice.kind, layer=l,
                                    signed=False).alignment.alpha
        edits["closed_form_paper_alpha"] = {"delta_O": ray(paper_alpha)}
        notes["closed_form_paper_alpha"] = {"alpha": paper_alpha, "alignment_target": target_alignment}
    except ValueError as exc:
        notes["closed_form_paper_alpha"] = {"unavailable": str(exc)}
    edits["closed_form_token_alpha"] = {"delta_O": ray(grad.closed_alpha[main])}
    notes["closed_form_token_alpha"] = {"alpha": float(grad.closed_alpha[main]),
                                        "reaches_target_prob": bool(grad.closed_feasible[main])}
    delta = np.asarray(grad.delta_O[main], np.float32)
    edits["gradient"] = {"delta_O": delta}
    notes["gradient"] = {k: v for k, v in grad.to_json(main).items() if not k.startswith("closed")}
    if act.feasible[main]:
        edits["activation_addition"] = {"vector": act.vector[main]}
        notes["activation_addition"] = {k: v for k, v in act.to_json(main).items() if not k.startswith("closed")}
    else:
        edits["activation_addition"] = {"vector": act.closed_norm[main] * u}
        notes["activation_addition"] = {"feasible": False, "note": "no feasible vector found; the closed-form ray "
                                        "v = c u at the target probability is reported"}
    conditions = edit_effects(model, texts, edits, target_id=tid, layer=l, controls=controls, paraphrases=paraphrases)
    for name, extra in notes.items():        # what edit_effects measured wins over the optimiser's own report
        conditions[name] = {**extra, **conditions.get(name, {})}
    # frontier: target probability against beta over the levels
    xj, vj = x0, valid
    point = lambda e: frontier_point(model, xj, vj, e, target_id=tid, layer=l)
    curves = {"closed form, token α": [point({"delta_O": ray(a)}) for a in grad.closed_alpha],
              f"gradient ΔO, rank ≤ {args.rank}": [point({"delta_O": grad.delta_O[i]}) for i in range(len(levels))
                                                  if grad.feasible[i]],
              "activation addition": [point({"vector": act.vector[i]}) for i in range(len(levels)) if act.feasible[i]]}
    if "closed_form_paper_alpha" in edits:
        curves["closed form, paper α"] = [point(edits["closed_form_paper_alpha"])]
    doc = {"settings": {**settings_of(args), "versions": io.versions()}, "direction": direction.to_json(),
           "objective": "token", "layer": l, "w": choice.kind, "w_choice": choice.to_json(),
           "target_prob": args.target_prob, "max_kl": args.max_kl, "rank": args.rank,
           "prompts": texts, "controls": list(CONTROL_PROMPTS) if controls is None else controls,
           "paraphrases": paraphrases,
           "effects": {"layer": l, "target_token": direction.token, "target_id": tid, "conditions": conditions},
           "frontier": {"target_prob_levels": levels,
                        "curves": {k: [{"layer_output_change": b, "target_prob_mean": p} for b, p in v]
                                   for k, v in curves.items()}}}
    with io.output_dir(args.out, command=args.command) as stage:
        io.write_json(os.path.join(stage, "steer.json"), doc)
        np.save(os.path.join(stage, "delta_O.npy"), delta)
        plot_frontier(curves, os.path.join(stage, "frontier.png"), levels=[args.target_prob],
                      title=f"Steering toward {direction.token!r} at layer {l}: target probability against β")
    print(f"wrote {args.out}: steer.json, delta_O.npy, frontier.png")
    print(f"  target {direction.token!r} (id {tid}), layer {l}, p >= {args.target_prob}, control KL <= {args.max_kl}")
    for name in ("before",) + METHODS:
        c = conditions.get(name, {})
        if "target_prob_mean" not in c:
            print(f"  {name:24s} unavailable: {c.get('unavailable', '')}")
            continue
        size = {"gradient": f"||dO||_F={c['delta_norm']:.4g} (rank {grad.delta_rank(main)})",
                "activation_addition": f"||v||={c['delta_norm']:.4g}",
                "before": ""}.get(name, f"alpha={c.get('alpha', float('nan')):.4g} ||dO||_F={c['delta_norm']:.4g}")
        print(f"  {name:24s} p mean {c['target_prob_mean']:.3f}  control KL {c['control_kl_mean']:.3f}  "
              f"beta {c['layer_output_change']:.4g}  {size}")
    return 0
