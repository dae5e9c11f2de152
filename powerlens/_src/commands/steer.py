"""``powerlens steer``: rank-1 steering of the last layer toward a direction u.

α comes from ``--alpha``, from ``--target-alignment c`` (the exact one-step relation of
the ``paper`` rule: the smallest α from which every token has cos(x, u) ≥ c after the
steered layer; the default, with c = 0.99), or ``--optimize`` learns a change ΔO of rank at
most ``--rank`` instead (optax: min ‖ΔO‖_F subject to the worst final alignment ≥ c; it has no
α, and is reported by its norm and rank beside the closed form at equal alignment). The
alignment is signed, cos(x, u): the tokens must point toward u; ``--sign-free`` targets
|cos(x, u)| (the paper's γ) instead. An edit that leaves the final tokens pointing away from u
(mean signed cosine < 0), or below the target, is reported as "not reached", with the signed
cosine and, for a ``token:`` direction on a decoder, p(token) before and after.

The folder gets steer.json, edit.npz (the edit as a file: :func:`powerlens.load_edit`,
:func:`powerlens.apply_edit`; ``steer MODEL --apply edit.npz`` reports its effects on other
prompts) and the figures. ``--apply`` (:func:`cmd_steer_apply`) writes steer.json with the
effects of a saved edit.

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
from .steer_limits import check_prompt_count, check_steps_option


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
    from .models import load_options, read_prompts
    texts = read_prompts(args)
    check_prompt_count(texts)
    model = load(args.model, **load_options(args))
    x0, valid = embed(model, texts)
    return model.layers, model, np.asarray(x0), np.asarray(valid), texts


def _final_cos(layers, x0, valid, u):
    """Signed alignment cos(x_i, u) of every valid final token under the paper rule (flat array)."""
    from ..steering.effects import final_cos
    return final_cos(layers, x0, valid, u)


def check_alpha_dtype(layers, u, w: str, alpha: float, layer: int = -1) -> None:
    """Refuse an alpha whose change alpha u w^T (and the alignment curve's, up to 10 alpha)
    overflows the dtype of the layer's output matrix."""
    from ..steering.rank1 import choose_w, host_matrices, layer_index
    l = layer_index(layers, layer)
    W_o, V, _ = host_matrices(layers, l)
    big = 10.0 * alpha * float(np.abs(u).max()) * float(np.abs(choose_w(V, u, w, l)).max()) + float(np.abs(W_o).max())
    dtype = np.dtype(layers.W_o.dtype)
    top = float(np.finfo(dtype).max) if np.issubdtype(dtype, np.floating) else float(np.finfo(np.float32).max)
    if not big < top:
        raise ValueError(f"--alpha {alpha:g} overflows {dtype.name}: alpha u w^T (and the alignment curve, up to "
                         f"10 alpha) reaches about {big:.3g}, beyond the largest {dtype.name} ({top:.3g}); give a "
                         f"smaller --alpha")


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
    from ..steering.effects import NEUTRAL_SENTENCES
    from ..steering.rank1 import check_alpha
    check_steps_option(args)
    if args.steps is not None and not args.optimize:
        raise ValueError("--steps sets the Adam steps of --optimize; give --optimize too")
    signed = not getattr(args, "sign_free", False)
    layers, model, x0, valid, texts = _system(args)
    budget.check(budget.run_estimate(**budget.shapes_of(layers), steps=len(layers.schedule), batch=x0.shape[0],
                                     tokens=x0.shape[1], gradients=args.optimize))
    if args.alpha is not None:
        check_alpha(args.alpha)
    target = check_target(args.target_alignment if args.target_alignment is not None else 0.99)
    if args.rank < 1:
        raise ValueError(f"--rank must be a positive integer, got {args.rank}")
    if args.optimize:
        from .steer_token import check_rank_option
        check_rank_option(layers, args.rank, layers.n_unique - 1)
    direction = parse_direction(args.direction, d=layers.config.d_model, model=model, seed=args.seed)
    u = direction.vector
    choice = layer_w_choice(layers, args.w)
    w = choice.kind
    if args.alpha is not None:
        check_alpha_dtype(layers, u, w, float(args.alpha))
    doc = {"settings": {**settings_of(args), "versions": io.versions()}, "direction": direction.to_json(),
           "w": w, "w_choice": choice.to_json()}
    if model is not None:
        from .models import dtypes_json
        doc["model"] = dtypes_json(model)
    if args.optimize:
        from ..steering.progress import SteerProgress
        with SteerProgress(not getattr(args, "quiet", False)) as progress:
            progress.stage(f"gradient dO (rank <= {args.rank}) toward {direction.label}", total=args.steps or 300,
                           levels=[target], announce=False, value="worst alignment")
            from ..steering import AlignmentObjective, SteeringConfig
            opt = optimize_steering(layers, x0, AlignmentObjective(u, target=target, reduce="min", signed=signed),
                                    edit="lowrank", valid=valid, progress=not getattr(args, "quiet", False),
                                    config=SteeringConfig(rank=args.rank, w=w, seed=args.seed, steps=args.steps))
        if not opt.feasible[0]:
            raise ValueError(f"--optimize found no change of rank <= {args.rank} reaching alignment {target} "
                             f"(the closed-form start reached {float(opt.closed_alignment[0]):.3g}); "
                             f"lower --target-alignment" + ("" if not signed else " or give --sign-free"))
        delta = np.asarray(opt.delta_O[0])
        doc["optimize"] = opt.to_json(0)
        alpha = float(opt.closed_alpha[0])          # the closed form's, at the same alignment: the reference
        method = f"gradient, rank <= {args.rank}"
    else:
        if args.alpha is not None:
            alpha = float(args.alpha)
            method = "closed form, given alpha"
        else:
            try:
                m = minimal_alpha(layers, u, x0, valid=valid, target=target, w=w, signed=signed)
            except ValueError as exc:
                if not signed or "no alpha > 0 gives every token" not in str(exc):
                    raise
                # the ray turns some token away from u as alpha grows: no alpha reaches the signed
                # target; the sign-free alpha is taken and the signed result reported as not reached
                doc["signed_target_unreachable"] = str(exc).split(";")[0]
                m = minimal_alpha(layers, u, x0, valid=valid, target=target, w=w, signed=False)
            doc["minimal_alpha"] = m.to_json()
            alpha = m.alignment.alpha
            method = (f"closed form, smallest alpha for alignment {target}" if "signed_target_unreachable" not in doc
                      else f"closed form, smallest alpha for sign-free alignment {target} (no alpha reaches the "
                           f"signed target)")
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
    signed_before = _final_cos(layers, x0, valid, u)
    signed_after = _final_cos(steered, x0, valid, u)
    solved_signed = signed and "signed_target_unreachable" not in doc    # what the alignment arrays hold
    pick = (lambda c: c) if solved_signed else np.abs
    before, after = pick(signed_before), pick(signed_after)
    away = bool(signed_after.mean() < 0)
    given = args.alpha is not None          # no alignment target: only the direction is judged
    reaches = (not away) if given else bool(after.min() >= target - 2e-5) and not away and solved_signed == signed
    doc["alignment"] = {"signed": solved_signed, "before": before.tolist(), "after": after.tolist(),
                        "mean_before": float(before.mean()), "mean_after": float(after.mean()),
                        "min_after": float(after.min()),
                        "signed_mean_before": float(signed_before.mean()), "signed_mean_after": float(signed_after.mean()),
                        "signed_min_after": float(signed_after.min()), "target": None if given else target,
                        "reaches_target": reaches, "points_away_from_u": away}
    # alignment against alpha (closed form, same w)
    grid = alpha * np.logspace(-2, 1, 13)
    curve_mean, curve_min = [], []
    for a in grid:
        c = pick(_final_cos(rank1(layers, u, alpha=float(a), w=w, spectrum=False).layers, x0, valid, u))
        curve_mean.append(float(c.mean()))
        curve_min.append(float(c.min()))
    doc["alignment_vs_alpha"] = {"alpha": grid.tolist(), "mean": curve_mean, "min": curve_min}
    p_line = None
    if model is not None:
        neutral = list(NEUTRAL_SENTENCES) if model.info.decoder else None
        doc["effects"] = output_effects(model, u, delta, texts, target_id=direction.token_id, neutral=neutral)
        conds = doc["effects"]["conditions"]
        if direction.token_id is not None and conds["before"].get("target_prob") is not None:
            p0, p1 = conds["before"]["target_prob_mean"], conds["rank1"]["target_prob_mean"]
            doc["target_prob"] = {"token": direction.token, "before": p0, "after": p1, "up": bool(p1 > p0)}
            h0, h1 = conds["before"]["alignment"], conds["rank1"]["alignment"]
            p_line = (f"  p({direction.token!r}) mean {p0:.4g} -> {p1:.4g} "
                      f"({'up' if p1 > p0 else 'down'}{f' x{p1 / p0:.3g}' if p0 > 0 else ''}); the model's own final states "
                      f"(rule full): signed cos(h, u) mean {h0:.3f} -> {h1:.3f}")
    doc["reaches_target"] = reaches
    edit_doc = {"objective": "alignment", "direction": direction.to_json(), "target_alignment": target,
                "signed": signed, "reaches_target": reaches}
    if args.optimize:
        edit = ("delta_O", dict(delta_O=delta), {"method": "gradient", "rank": args.rank, "steps": args.steps or 300,
                                                  "seed": args.seed, "w": w})
    else:
        edit = ("rank1", dict(delta_O=r1.delta_O, u=r1.u, w=r1.w, alpha=alpha), {"method": method, "w": w})
    with io.output_dir(args.out, command=args.command) as stage:
        io.write_json(os.path.join(stage, "steer.json"), doc)
        if model is not None:
            from ..steering.edit_file import make_edit, save_edit
            save_edit(os.path.join(stage, "edit.npz"), make_edit(model, edit[0], r1.layer, **edit[1], target=edit_doc,
                                                                 options=edit[2]))
        label = "cos(x_final, u)" if solved_signed else "|cos(x_final, u)|"
        plots.plot_curve(grid, {"mean over tokens": np.array(curve_mean), "worst token": np.array(curve_min)},
                         os.path.join(stage, "alignment_vs_alpha.png"), xlabel="α", ylabel=label,
                         logx=True, hlines={"target": target}, title=f"Closed form: alignment against α ({direction.label})")
        plots.plot_histogram_before_after(signed_before, signed_after, os.path.join(stage, "alignment_hist.png"),
                                          xlabel="cos(x_final, u) (paper rule, signed: > 0 toward u)",
                                          title=f"{method}: {size_title}")
        if model is not None and model.info.decoder:
            labels, pb, pa = _topk_bars(model, delta, r1.layer, x0, valid, direction.token_id)
            plots.plot_bars(labels, pb, pa, os.path.join(stage, "topk.png"),
                            title=f"Next token after the first prompt: before vs after steering toward {direction.label}")
    print(f"wrote {args.out}: steer.json{', edit.npz' if model is not None else ''} and figures")
    print(f"  {choice.describe()}")
    kind = "signed cos(x, u)" if solved_signed else "|cos(x, u)|"
    print(f"  {method}: {size}  {kind} mean {before.mean():.3f} -> {after.mean():.3f} (min {after.min():.3f}; "
          f"{'no target' if given else f'target {target}'})")
    if not solved_signed:
        print(f"  signed cos(x, u) mean {signed_before.mean():.3f} -> {signed_after.mean():.3f}")
    if p_line:
        print(p_line)
    if "signed_target_unreachable" in doc:
        print(f"  {doc['signed_target_unreachable']}")
    if away:
        print(f"  not reached: the final tokens point away from u (signed cos mean {signed_after.mean():.3f})")
    elif given:
        print(f"  the final tokens point toward u (signed cos mean {signed_after.mean():.3f})")
    elif not reaches and solved_signed != signed:
        print(f"  not reached: min signed cos(x, u) {signed_after.min():.3f} < {target} (the sign-free target is met, "
              f"but not every token points toward u)")
    elif not reaches:
        print(f"  not reached: min {kind} {after.min():.3f} < {target}")
    else:
        print(f"  reached: every final token has {kind} >= {target}")
    if reference:
        print(reference)
    return 0


def cmd_steer_apply(args) -> int:
    """``steer MODEL --apply EDIT``: the effects of a saved edit on the prompts (steer.json)."""
    from ..models import load
    from ..steering.compare import edit_effects
    from ..steering.edit_file import check_identity, load_edit
    from .models import load_options, read_prompts
    if not args.model:
        raise ValueError("--apply needs MODEL, the model the edit was made for")
    token_only = [f for f, v in (("--paraphrases", args.paraphrases), ("--layer", args.layer),
                                 ("--init", args.init)) if v is not None]
    if token_only:
        raise ValueError(f"{token_only[0]} cannot be combined with --apply (the edit fixes its layer)")
    edit = load_edit(args.apply)
    texts = read_prompts(args)
    check_prompt_count(texts)
    from .steer_token import prompt_lines
    controls = prompt_lines(args.controls, "--controls") if args.controls else edit.target.get("controls")
    model = load(args.model, **load_options(args))
    check_identity(model, edit, f"edit file {args.apply!r}")
    if not model.info.decoder:
        raise ValueError(f"--apply reports next-token effects and needs a causal decoder; {args.model!r} is a "
                         f"{model.info.family} encoder")
    tid = edit.target.get("token_id", (edit.target.get("direction") or {}).get("token_id"))
    conditions = edit_effects(model, texts, {"edit": edit.to_edit()}, target_id=tid, layer=edit.layer,
                              controls=controls)
    from .models import dtypes_json
    doc = {"settings": {**settings_of(args), "versions": io.versions()}, "model": dtypes_json(model),
           "apply": edit.metadata(),
           "prompts": texts, "effects": {"layer": edit.layer, "target_id": tid, "conditions": conditions}}
    with io.output_dir(args.out, command=args.command) as stage:
        io.write_json(os.path.join(stage, "steer.json"), doc)
    before, after = conditions["before"], conditions["edit"]
    print(f"wrote {args.out}: steer.json")
    print(f"  applied {args.apply}: {edit.kind} edit of layer {edit.layer}, rank {edit.rank}, norm {edit.norm:.4g}")
    if tid is not None:
        token = edit.target.get("token", (edit.target.get("direction") or {}).get("token"))
        label = repr(token) if token is not None else f"id {tid}"
        print(f"  p({label}) mean {before['target_prob_mean']:.4g} -> {after['target_prob_mean']:.4g} "
              f"(min {min(after['target_prob']):.4g})")
    print(f"  control KL {after['control_kl_mean']:.4g}")
    for text, cont in zip(texts, after.get("continuation") or []):
        print(f"  {text!r} -> {cont!r}")
    return 0
