"""``powerlens steer MODEL --objective token``: make a token the model's own next token.

Four methods edit one layer (``--layer``, default the last) and are compared on the model's
forward pass (rule ``full``, :mod:`powerlens._src.steering.compare`):

    closed_form_paper_alpha   O += alpha u w^T at the paper rule's alpha (alignment
                              ``--target-alignment``, default 0.99)
    closed_form_token_alpha   the same ray, alpha chosen so that every prompt reaches ``--target-prob``
    gradient                  a learned dO of rank <= ``--rank``: min ||dO||_F subject to
                              p(token) >= ``--target-prob`` at every prompt and mean control
                              KL <= ``--max-kl`` (optax, augmented Lagrangian, ``--steps``
                              Adam steps, default 300)
    activation_addition       the same problem over a vector v added to the layer's output

The two optimised methods run at the frontier levels 0.1/0.3/0.5/0.9 and ``--target-prob``
at once (one vmapped loop each). Before anything runs, the options are bounded (``--rank`` at
most min(d, H e), at most ``STEER_MAX_PROMPTS`` lines per prompt file, each prompt within the
model's positions, naming the file and line), the memory is estimated and the plan printed.
Progress (stage, Adam step, p and KL so far at each level, elapsed, ETA) goes to stderr
(:mod:`powerlens._src.steering.progress`; ``--quiet`` silences it).

The folder gets steer.json (``effects.conditions.<method>``, each with ``reaches_target``),
edit.npz (the learned dO as an edit file: :func:`powerlens.load_edit`,
:func:`powerlens.apply_edit`, ``steer MODEL --apply``), edit_activation_addition.npz (the
activation-addition vector, when one was found), delta_O.npy (the same dO, (d, H e), as a bare
array) and frontier.png (target probability against beta, the change of the layer's output,
over the levels; edits that miss their level are listed under the axes, not drawn).
"""
from __future__ import annotations

import os

import numpy as np

from .. import io
from . import budget
from .simulate import settings_of
from .steer_limits import check_prompt_count, check_steps_option

FRONTIER_LEVELS = (0.1, 0.3, 0.5, 0.9)
DEFAULT_PARAPHRASES = {
    "The capital of France is": ("France's capital city is", "The capital city of France is",
                                 "The French capital is"),
}
NOT_FOUND = (float("nan"), float("nan"), False)     # a frontier level the optimiser found no edit for
METHODS = ("closed_form_paper_alpha", "closed_form_token_alpha", "gradient", "activation_addition")


def numbered_lines(path: str, flag: str):
    """[(line number, prompt)] of a prompts file (blank lines skipped; errors name ``flag``), at
    most STEER_MAX_PROMPTS of them."""
    from .steer_limits import STEER_MAX_PROMPTS
    from .models import read_prompts_file
    try:
        texts = read_prompts_file(path)
    except ValueError as exc:
        raise ValueError(str(exc).replace("--prompts", flag)) from None
    if len(texts) > STEER_MAX_PROMPTS:
        raise ValueError(f"{flag} file {path!r} has {len(texts)} prompts; steer takes at most {STEER_MAX_PROMPTS} "
                         f"per file")
    with open(path, "rb") as fh:
        numbers = [i for i, line in enumerate(fh.read().splitlines(), 1) if line.strip()]
    return list(zip(numbers, texts))


def prompt_lines(path: str, flag: str):
    """The prompts of the file ``path`` given with option ``flag``, one a line (see :func:`numbered_lines`)."""
    return [t for _, t in numbered_lines(path, flag)]


def _paraphrases(args, texts):
    if args.paraphrases:
        return prompt_lines(args.paraphrases, "--paraphrases")
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
    check_steps_option(args)
    if not args.direction.startswith("token:"):
        raise ValueError(f"--objective token needs --direction token:WORD (the target token), got {args.direction!r}")


def check_layer_option(layers, layer) -> int:
    """``--layer`` as a unique-layer index: counted from 0, -1 the last; one line naming the option."""
    U = layers.n_unique
    if layer is None:
        return U - 1
    if not -U <= layer < U:
        raise ValueError(f"--layer {layer} is out of range: the model has {U} layer(s), counted from 0 "
                         f"(0 .. {U - 1}); -1 is the last")
    return int(layer) % U


def check_rank_option(layers, rank: int, layer: int) -> None:
    """``--rank`` at most min(d, H e): the largest rank a change of W_o (d, H e) can have."""
    d, He = int(layers.config.d_model), int(layers.W_o.shape[-1])
    if rank > min(d, He):
        raise ValueError(f"--rank {rank} exceeds min(d, H*d_head) = min({d}, {He}) = {min(d, He)}, the largest "
                         f"rank a change of layer {layer}'s output matrix can have")


def check_prompt_lengths(model, sets) -> int:
    """Refuse a prompt longer than the model's positions, naming its option and file line.
    ``sets``: (option, file or None, [(line, text)]). Returns the longest prompt's token count."""
    from ..models.embed import prompt_ids
    info = model.info
    limit = None if info is None or info.max_positions is None else info.max_positions - info.position_offset
    longest = 0
    for flag, path, rows in sets:
        if not rows:
            continue
        ids = prompt_ids(model, [t for _, t in rows])
        for (line, _), r in zip(rows, ids):
            if limit is not None and len(r) > limit:
                where = f"{flag} file {path!r} line {line}" if path else f"{flag} {line}"
                raise ValueError(f"{where}: the prompt has {len(r)} tokens, more than the model's {limit} positions "
                                 f"({info.family}); shorten it (powerlens does not truncate)")
            longest = max(longest, len(r))
    return longest


def token_estimate(layers, *, targets: int, rows: int, tokens: int, tail_steps: int, vocab: int):
    """Memory of one token optimisation (:func:`powerlens._src.steering.token.optimize_token`):
    ``targets`` levels vmapped, each with the prompts and controls (``rows``) through the
    ``tail_steps`` edited steps with gradients, and their logits (3 copies of K rows V floats)."""
    est = budget.run_estimate(**budget.shapes_of(layers), steps=max(tail_steps, 1), batch=targets * rows,
                              tokens=tokens, gradients=True)
    est.parts["logits"] = 3 * targets * rows * int(vocab) * 4
    est.advice = "use fewer or shorter prompts or controls, or a later --layer"
    return est


def _not_finite(model, texts, controls, l):
    """The first prompt ("prompt i" or "control i") whose unedited next-token logits are not
    finite, or None."""
    from ..models.embed import embed
    from ..steering.compare import last_logp
    from ..steering.effects import forward_final
    from ..steering.token import CONTROL_PROMPTS
    for what, rows in (("prompt", texts), ("control prompt", list(CONTROL_PROMPTS) if controls is None else controls)):
        x0, valid = embed(model, rows)
        lg, _ = last_logp(model, forward_final(model, x0, valid, layer=l)[0], valid)
        bad = ~np.all(np.isfinite(np.asarray(lg, np.float64)), axis=-1)
        if bad.any():
            return f"{what} {int(np.argmax(bad))}"
    return None


REACH_TOL = 1e-5
"""Slack of "reached" (in p and in nats): the float32 rounding of a probability measured on the
model's forward pass, which is another computation than the optimiser's (a closed-form alpha
bisected to the boundary measures within a few 1e-6 of it)."""


def reached(c: dict, target_prob: float, max_kl: float, tol: float = REACH_TOL) -> bool:
    """p(target) >= target_prob at every prompt and mean control KL <= max_kl (within ``tol``)."""
    p = np.asarray(c.get("target_prob", []), np.float64)
    kl = c.get("control_kl_mean")
    return bool(p.size and np.all(np.isfinite(p)) and p.min() >= target_prob - tol and kl is not None
                and np.isfinite(kl) and kl <= max_kl + tol)


def cmd_steer_token(args) -> int:
    from ..models import embed, load
    from ..steering import CONTROL_PROMPTS, layer_w_choice, minimal_alpha, optimize_steering, parse_direction, rank1
    from ..steering.alpha import check_target
    from ..steering.compare import edit_effects, frontier_point, plot_frontier
    from ..steering.edit_file import make_edit, save_edit
    from ..steering.progress import SteerProgress, format_levels
    from .models import load_options, read_prompts
    _check(args)
    target_alignment = check_target(args.target_alignment if args.target_alignment is not None else 0.99)
    texts = read_prompts(args)
    check_prompt_count(texts)
    control_rows = numbered_lines(args.controls, "--controls") if args.controls else None
    controls = None if control_rows is None else [t for _, t in control_rows]
    paraphrase_rows = numbered_lines(args.paraphrases, "--paraphrases") if args.paraphrases else None
    paraphrases = [t for _, t in paraphrase_rows] if paraphrase_rows else _paraphrases(args, texts)
    model = load(args.model, **load_options(args))
    if not model.info.decoder:
        raise ValueError(f"--objective token needs a causal decoder; {args.model!r} is a {model.info.family} encoder")
    layers = model.layers
    l = check_layer_option(layers, args.layer)
    check_rank_option(layers, args.rank, l)
    prompt_rows = [(i, t) for i, t in enumerate(texts)]
    longest = check_prompt_lengths(model, [
        ("prompt", None, prompt_rows),
        ("--controls", args.controls, control_rows or [(i, t) for i, t in enumerate(CONTROL_PROMPTS)]),
        ("--paraphrases", args.paraphrases, paraphrase_rows or [(i, t) for i, t in enumerate(paraphrases or [])])])
    x0, valid = (np.asarray(a) for a in embed(model, texts))
    budget.check(budget.run_estimate(**budget.shapes_of(layers), steps=len(layers.schedule), batch=x0.shape[0],
                                     tokens=x0.shape[1], gradients=True))
    direction = parse_direction(args.direction, d=layers.config.d_model, model=model, seed=args.seed)
    u, tid = direction.vector, int(direction.token_id)
    choice = layer_w_choice(layers, args.w, l)
    levels = sorted(set(FRONTIER_LEVELS) | {float(args.target_prob)})
    main = levels.index(float(args.target_prob))
    steps = 300 if args.steps is None else args.steps
    n_controls = len(CONTROL_PROMPTS) if controls is None else len(controls)
    tail = len(layers.schedule) - layers.schedule.steps_of(l)[0]
    from ..models.layout import vocabulary_rows
    est = budget.check(token_estimate(layers, targets=len(levels), rows=len(texts) + n_controls, tokens=longest,
                                      tail_steps=tail, vocab=vocabulary_rows(model)))
    bad = _not_finite(model, texts, controls, l)
    if bad is not None:
        raise ValueError(f"the model's next-token logits on {bad} are not finite before any edit: a value "
                         f"overflowed {np.dtype(layers.W_v.dtype).name} in its forward pass (weights or activations "
                         f"too large for that dtype); steering cannot be measured on it")
    print(f"steer {direction.token!r} (id {tid}) at layer {l} of {layers.n_unique}: 4 methods (closed form at the "
          f"paper's alpha, closed form at the token's alpha, gradient dO of rank <= {args.rank}, activation "
          f"addition); the two optimised ones run {steps} Adam steps at the levels {format_levels(levels)} at once; "
          f"{len(texts)} prompt(s), {n_controls} control(s), {len(paraphrases or [])} paraphrase(s); "
          f"memory {est.describe()}", flush=True)
    from ..steering import SteeringConfig, TokenObjective
    goal = TokenObjective([tid] * len(levels), target_prob=levels, max_kl=args.max_kl, controls=controls)
    common = dict(valid=valid, progress=not args.quiet,
                  config=SteeringConfig(layer=l, rank=args.rank, seed=args.seed, w=choice.kind, steps=args.steps))
    with SteerProgress(not args.quiet) as progress:
        progress.stage(f"gradient dO (rank <= {args.rank})", total=steps, levels=levels)
        grad = optimize_steering(model, x0, goal, edit="lowrank", **common)
        progress.stage("activation addition", total=steps, levels=levels)
        act = optimize_steering(model, x0, goal, edit="activation", **common)
        progress.end_stage()
        if not grad.feasible[main]:
            raise ValueError(f"--optimize found no change of rank <= {args.rank} of layer {l} with "
                             f"p({direction.token!r}) >= {args.target_prob} at every prompt and control KL <= "
                             f"{args.max_kl}; lower --target-prob or raise --max-kl")
        ray = lambda alpha: rank1(layers, u, alpha=float(alpha), w=choice.kind, layer=l, spectrum=False).delta_O
        edits, notes = {}, {}
        progress.stage("closed form at the paper's alpha")
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
        progress.stage(f"effects of the {len(edits)} edits (prompts, controls, paraphrases, continuations)")
        conditions = edit_effects(model, texts, edits, target_id=tid, layer=l, controls=controls,
                                  paraphrases=paraphrases)
        for name, extra in notes.items():        # what edit_effects measured wins over the optimiser's own report
            conditions[name] = {**extra, **conditions.get(name, {})}
        for name in METHODS:
            if "target_prob" in conditions.get(name, {}):
                conditions[name]["reaches_target"] = reached(conditions[name], args.target_prob, args.max_kl)
        # frontier: target probability against beta over the levels, each point marked reached or not
        progress.stage(f"frontier ({len(levels)} levels)")
        point = lambda e, level: _frontier_point(model, x0, valid, e, tid, l, level, frontier_point)
        curves = {"closed form, token α": [point({"delta_O": ray(a)}, lv) for a, lv in zip(grad.closed_alpha, levels)],
                  f"gradient ΔO, rank ≤ {args.rank}": [point({"delta_O": grad.delta_O[i]}, lv) if grad.feasible[i]
                                                      else NOT_FOUND for i, lv in enumerate(levels)],
                  "activation addition": [point({"vector": act.vector[i]}, lv) if act.feasible[i] else NOT_FOUND
                                          for i, lv in enumerate(levels)]}
        if "closed_form_paper_alpha" in edits:
            c = conditions["closed_form_paper_alpha"]
            curves["closed form, paper α"] = [(c["layer_output_change"], c["target_prob_mean"],
                                               bool(c.get("reaches_target")))]
        progress.end_stage()
    target = {"objective": "token", "token": direction.token, "token_id": tid, "target_prob": args.target_prob,
              "max_kl": args.max_kl, "prompts": texts, "controls": list(CONTROL_PROMPTS) if controls is None else controls}
    options = {"rank": args.rank, "steps": steps, "seed": args.seed, "w": choice.kind}
    saved = {"edit.npz": make_edit(model, "delta_O", l, delta_O=delta, target={
        **target, "target_prob_reached": conditions["gradient"].get("target_prob")},
        options={**options, "method": "gradient"})}
    if act.feasible[main]:
        saved["edit_activation_addition.npz"] = make_edit(model, "activation", l, vector=act.vector[main], target={
            **target, "target_prob_reached": conditions["activation_addition"].get("target_prob")},
            options={**options, "method": "activation_addition"})
    from .models import dtypes_json
    doc = {"settings": {**settings_of(args), "versions": io.versions()}, "direction": direction.to_json(),
           "model": dtypes_json(model), "objective": "token", "layer": l, "w": choice.kind, "w_choice": choice.to_json(),
           "target_prob": args.target_prob, "max_kl": args.max_kl, "rank": args.rank,
           "prompts": texts, "controls": list(CONTROL_PROMPTS) if controls is None else controls,
           "paraphrases": paraphrases,
           "edit_files": {name: {"method": e.options["method"], "kind": e.kind} for name, e in saved.items()},
           "effects": {"layer": l, "target_token": direction.token, "target_id": tid, "conditions": conditions},
           "frontier": {"target_prob_levels": levels,
                        "curves": {k: [{"layer_output_change": b, "target_prob_mean": p, "reached": ok}
                                       for b, p, ok in v] for k, v in curves.items()}}}
    with io.output_dir(args.out, command=args.command) as stage:
        io.write_json(os.path.join(stage, "steer.json"), doc)
        for name, e in saved.items():
            save_edit(os.path.join(stage, name), e)
        io.save_npy(os.path.join(stage, "delta_O.npy"), delta)
        plot_frontier(curves, os.path.join(stage, "frontier.png"), levels=[args.target_prob],
                      title=f"Steering toward {direction.token!r} at layer {l}: target probability against β")
    print(f"wrote {args.out}: steer.json, {', '.join(saved)}, delta_O.npy, frontier.png")
    print(f"  target {direction.token!r} (id {tid}), layer {l}, p >= {args.target_prob}, control KL <= {args.max_kl}")
    p0 = conditions["before"]["target_prob_mean"]
    for name in ("before",) + METHODS:
        c = conditions.get(name, {})
        if "target_prob_mean" not in c:
            print(f"  {name:24s} unavailable: {c.get('unavailable', '')}")
            continue
        size = {"gradient": f"||dO||_F={c['delta_norm']:.4g} (rank {grad.delta_rank(main)})",
                "activation_addition": f"||v||={c['delta_norm']:.4g}",
                "before": ""}.get(name, f"alpha={c.get('alpha', float('nan')):.4g} ||dO||_F={c['delta_norm']:.4g}")
        reasons = []
        if name != "before" and not c.get("reaches_target"):
            if min(c["target_prob"]) < args.target_prob - REACH_TOL:
                reasons.append(f"p min {min(c['target_prob']):.6g} < {args.target_prob}")
            if c["control_kl_mean"] > args.max_kl + REACH_TOL:
                reasons.append(f"control KL {c['control_kl_mean']:.6g} > {args.max_kl}")
        verdict = "" if name == "before" else "  reached" if c.get("reaches_target") else \
            "  not reached" + (f" ({'; '.join(reasons)})" if reasons else "")
        moved = "" if name == "before" else f" (from {p0:.3g})"
        print(f"  {name:24s} p mean {c['target_prob_mean']:.3f}{moved}  control KL {c['control_kl_mean']:.3f}  "
              f"beta {c['layer_output_change']:.4g}  {size}{verdict}")
    return 0


def _frontier_point(model, x0, valid, edit, tid, layer, level, frontier_point):
    """(beta, mean p, whether min p over prompts reached ``level``) of one edit."""
    beta, p_mean, p_min = frontier_point(model, x0, valid, edit, target_id=tid, layer=layer, with_min=True)
    return beta, p_mean, bool(p_min >= level - REACH_TOL)
