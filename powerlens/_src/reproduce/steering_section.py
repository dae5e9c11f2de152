"""Section 7: steering the last layer toward a chosen direction u, on MiniLM, SmolLM2 and Gemma 3.

For each model and its token direction u (the unembedding row of a word):
  closed form   O' = O + alpha u w^T, w = V u/||V u||, alpha the smallest value that puts
                every token at cos >= c after the last layer (exact one-step relation);
  gradient      optax, min ||dO||_F (rank 1) subject to the same worst-token alignment;
  activation    add beta u to the last layer's output, beta = the mean norm of the change
  addition      the rank-1 edit makes there (equal change norm).
The spectral claim is checked on F': the steered eigenvalue is principal (shifted
ordering) and its eigenvector is close to u.

Two claims, two verdicts, each computed from its own numbers:

  paper claim    the closed form aligns every final token with u under the paper rule
                 (:func:`paper_claim_verdict`, from the checks above);
  output claim   the edit makes the target the model's own next token (rule ``full``)
                 without large side effects (:func:`output_claim_verdict`). On SmolLM2 and
                 Gemma 3, for the 8 targets :data:`OUTPUT_WORDS` (``--quick``: the first 4) and the prompts
                 :data:`OUTPUT_PROMPTS`, the four methods of ``powerlens steer --objective
                 token`` (closed form at the paper-rule alpha, closed form with alpha for the
                 token objective, gradient rank-1 dO, activation addition; the two optimised
                 ones solve all targets in one vmapped call each) are measured by
                 :func:`powerlens._src.steering.compare.edit_effects`. A target is reached when
                 p(target) >= 0.5 at every prompt and the mean control KL <= 0.5 (within
                 1e-3); each method gets its share of targets reached and the median beta
                 (the change of the edited layer's output) it needs.
"""
from __future__ import annotations

import functools
from typing import Mapping, Optional, Sequence, Tuple

import numpy as np

from .real_models import DEFAULT_MODELS, cached_model, section_prompts, available_models
from .section import SectionResult, Table, verdict_from

WORDS = {"minilm": "king", "smollm2": "Paris", "gemma3": "Paris"}
TARGET = 0.9


def _compute(name: str, ctx) -> dict:
    from ..models import embed
    from ..steering import (AlignmentObjective, SteeringConfig, minimal_alpha, optimize_steering, output_effects,
                            parse_direction, rank1)
    from ..steering.effects import NEUTRAL_SENTENCES
    model = cached_model(name)
    texts = section_prompts(ctx)
    x0, valid = embed(model, texts)
    x0, valid = np.asarray(x0), np.asarray(valid)
    direction = parse_direction(f"token:{WORDS[name]}", model=model)
    u = direction.vector
    layers = model.layers
    m = minimal_alpha(layers, u, x0, valid=valid, target=TARGET, w="value", signed=False)
    alpha = m.alignment.alpha
    r1 = rank1(layers, u, alpha=alpha, w="value")
    spec = m.principal                     # (a) spectral, computed by minimal_alpha with the same w and cos_tol
    opt = optimize_steering(layers, x0, AlignmentObjective(u, target=TARGET, reduce="min", signed=False),
                            edit="lowrank", valid=valid,
                            config=SteeringConfig(rank=1, w="value", steps=150 if ctx.quick else 300, seed=ctx.seed))
    neutral = list(NEUTRAL_SENTENCES[:2]) if model.info.decoder else None
    effects = output_effects(model, u, {"closed": r1.delta_O, "gradient": np.asarray(opt.delta_O[0])}, texts,
                             target_id=direction.token_id, neutral=neutral)
    eff_closed, eff_grad = effects["closed"], effects["gradient"]
    sweep = alpha * np.logspace(-2, 0.5, 8)
    curve = []
    for a in sweep:
        eff = rank1(layers, u, alpha=float(a), w="value", spectrum=False)
        from ..steering.effects import paper_alignment
        curve.append(paper_alignment(eff.layers, x0, valid, u)["abs_min"])
    strip = lambda e: {k: ({c: {kk: vv for kk, vv in v.items() if kk != "alignment_per_token"}
                            for c, v in e["conditions"].items()} if k == "conditions" else v) for k, v in e.items()}
    return {"model": name, "word": WORDS[name], "token": direction.token, "target": TARGET,
            "closed": {"alpha": alpha, "norm": r1.delta_norm, "rank1": {k: v for k, v in r1.to_json().items()
                                                                          if k != "spectrum"},
                       "effects": strip(eff_closed)},
            "principal_alpha": spec.to_json(),
            "gradient": {**opt.to_json(0), "effects": strip(eff_grad)},
            "alpha_curve": {"alpha": sweep.tolist(), "min_alignment": curve},
            "per_token_before": eff_closed["conditions"]["before"]["alignment_per_token"],
            "per_token_full_rank1": eff_closed["conditions"]["rank1"]["alignment_per_token"]}


# --------------------------------------------------------------------------- the output claim

OUTPUT_MODELS = ("smollm2", "gemma3")
OUTPUT_WORDS = (" London", " Berlin", " Rome", " Madrid", " Paris", " Tokyo", " Moscow", " Vienna")
OUTPUT_PROMPTS = ("The capital of France is", "Next week we are flying to")
TARGET_PROB = 0.5          # p(target) needed at every prompt
MAX_KL = 0.5               # mean KL(p_base || p_edited) allowed over the control prompts (nats)
TOLERANCE = 1e-3           # slack on both, the optimiser's own feasibility slack being smaller
SHARE_NEEDED = 0.75        # the output claim holds on a model when an optimised edit reaches this share
QUICK_STEPS = 20           # Adam steps per target with --quick (the full run: the optimiser's default)
QUICK_TARGETS = 4          # with --quick the first 4 of OUTPUT_WORDS (the closed-form start's 71 head
                           # evaluations per target, not the Adam steps, bound the quick run)
OPTIMISED = ("gradient", "activation_addition")
METHOD_LABELS = {"closed_form_paper_alpha": "closed form, paper α", "closed_form_token_alpha": "closed form, token α",
                 "gradient": "gradient ΔO, rank 1", "activation_addition": "activation addition"}
METHODS = tuple(METHOD_LABELS)


def reaches(target_prob: Sequence[float], control_kl: float, *, level: float = TARGET_PROB, max_kl: float = MAX_KL,
            tol: float = TOLERANCE) -> bool:
    """True when p(target) >= level at every prompt and the mean control KL <= max_kl (both
    within ``tol``); False for missing or non-finite numbers."""
    p = np.asarray(target_prob if target_prob is not None else [np.nan], np.float64)
    kl = np.float64(np.nan if control_kl is None else control_kl)
    return bool(p.size and np.all(np.isfinite(p)) and np.isfinite(kl) and p.min() >= level - tol
                and kl <= max_kl + tol)


def _measured(e: dict) -> dict:
    """One condition of :func:`~powerlens._src.steering.compare.edit_effects`, reduced to the numbers of
    the output claim (and the most probable next token of each prompt)."""
    return {"target_prob": e["target_prob"], "min_target_prob": float(min(e["target_prob"])),
            "target_rank": e["target_rank"], "top_token": [row[0]["token"] for row in e["topk"]],
            "control_kl_mean": max(0.0, e["control_kl_mean"]), "beta": e["layer_output_change"],   # KL >= 0
            "delta_norm": e["delta_norm"], "reached": reaches(e["target_prob"], e["control_kl_mean"])}


def output_claim_numbers(model, prompts: Sequence[str], target_ids: Sequence[int], *, steps: Optional[int],
                         seed: int = 0, alignment_target: float = TARGET, controls=None) -> dict:
    """The four methods on K targets of a causal decoder (module docstring), last layer, w = V u/‖V u‖.

    The closed form at the paper-rule alpha is exact (one-step relation,
    :func:`~powerlens._src.steering.alpha.alignment_alpha`, every token at |cos| >= ``alignment_target``);
    the gradient dO (rank 1) and activation addition are each one vmapped
    ``optimize_steering(model, x0, TokenObjective(...))`` over the K targets (``steps`` Adam steps, None for
    its default), whose closed-form start gives the token alpha. Every edit is then measured
    on the model's own forward pass. Returns a JSON-ready dict with one entry per target
    ({method: numbers of :func:`_measured`, or {"found": False}}) and the settings."""
    from ..models import embed
    from ..models.layout import unembedding_matrix
    from ..steering import SteeringConfig, TokenObjective, optimize_steering, rank1
    from ..steering.alpha import alignment_alpha, entering_states
    from ..steering.compare import edit_effects
    layers = model.layers
    ids = [int(t) for t in target_ids]
    x0, valid = (np.asarray(a) for a in embed(model, list(prompts)))
    rows = unembedding_matrix(model, rows=ids)
    U = rows / np.linalg.norm(rows, axis=-1, keepdims=True)        # the targets' unit read-out rows, as in token.py
    X, vb = entering_states(layers, x0, valid, rule="paper")
    paper_alpha = [alignment_alpha(layers, X, u, target=alignment_target, valid=vb, w="value", signed=False).alpha
                   for u in U]
    goal = TokenObjective(ids, target_prob=TARGET_PROB, max_kl=MAX_KL, controls=controls)
    config = SteeringConfig(rank=1, steps=steps, seed=seed, w="value")
    grad = optimize_steering(model, x0, goal, edit="lowrank", valid=valid, config=config)
    act = optimize_steering(model, x0, goal, edit="activation", valid=valid, config=config)
    ray = lambda u, a: rank1(layers, u, alpha=float(a), w="value", spectrum=False).delta_O
    targets = []
    for k, (tid, u) in enumerate(zip(ids, U)):
        edits = {"closed_form_paper_alpha": {"delta_O": ray(u, paper_alpha[k])},
                 "closed_form_token_alpha": {"delta_O": ray(u, grad.closed_alpha[k])}}
        if grad.feasible[k]:
            edits["gradient"] = {"delta_O": grad.delta_O[k]}
        if act.feasible[k]:
            edits["activation_addition"] = {"vector": act.vector[k]}
        eff = edit_effects(model, list(prompts), edits, target_id=tid, controls=controls, continuation_tokens=0)
        row = {"target_id": tid, "before": _measured(eff["before"])}
        row.update({name: (_measured(eff[name]) if name in eff else {"found": False, "reached": False})
                    for name in METHODS})
        row["closed_form_paper_alpha"]["alpha"] = float(paper_alpha[k])
        row["closed_form_token_alpha"].update(alpha=float(grad.closed_alpha[k]),
                                              ray_reaches_target_prob=bool(grad.closed_feasible[k]))
        if grad.feasible[k]:
            row["gradient"]["delta_rank"] = grad.delta_rank(k)
        targets.append(row)
    return {"prompts": list(prompts), "target_prob": TARGET_PROB, "max_kl": MAX_KL, "tolerance": TOLERANCE,
            "alignment_target": alignment_target, "steps": steps, "targets": targets}


def method_summary(targets: Sequence[dict], method: str) -> dict:
    """Over the targets of :func:`output_claim_numbers`: how many ``method`` reaches, their share,
    the median beta over the reached ones (None when none is) and over all measured ones, and
    the median worst-prompt target probability and control KL."""
    got = [t[method] for t in targets if "beta" in t[method]]
    won = [g for g in got if g["reached"]]
    med = lambda xs: float(np.median(xs)) if len(xs) else None
    return {"targets": len(targets), "reached": len(won), "share": len(won) / len(targets) if targets else 0.0,
            "median_beta_reached": med([g["beta"] for g in won]), "median_beta": med([g["beta"] for g in got]),
            "median_min_target_prob": med([g["min_target_prob"] for g in got]),
            "median_control_kl": med([g["control_kl_mean"] for g in got]),
            "median_delta_norm_reached": med([g["delta_norm"] for g in won])}


def output_claim_verdict(shares: Mapping[str, Mapping[str, float]], *, share_needed: float = SHARE_NEEDED,
                         methods: Sequence[str] = OPTIMISED) -> Tuple[str, dict]:
    """(verdict, checks) of the output claim from {model: {method: share of targets reached}}.

    One check per model: the best of ``methods`` (the optimised edits) reaches at least
    ``share_needed`` of the targets. All models: supported; some: partly; none: not
    supported; no model measured: skipped."""
    checks = {f"output claim, {model}: the gradient ΔO or activation addition makes the target the next token "
              f"(p ≥ {TARGET_PROB} at every prompt, control KL ≤ {MAX_KL}) for ≥ {share_needed:.0%} of the targets":
              bool(max(float(by_method.get(m, 0.0)) for m in methods) >= share_needed)
              for model, by_method in shares.items()}
    return (verdict_from(checks) if checks else "skipped"), checks


def paper_claim_verdict(rows: Sequence[dict], *, target: float = TARGET) -> Tuple[str, dict]:
    """(verdict, checks) of the paper claim from the chunks of :func:`_compute` (the paper-rule
    alignment numbers): all checks hold: supported; some: partly; none: not supported."""
    checks = {
        "paper claim: the steered eigenvalue becomes principal with an eigenvector close to u (|cos| ≥ 0.95)": all(
            r["principal_alpha"]["cos"] >= 0.95 for r in rows),
        f"paper claim: the closed form puts every token at |cos| ≥ {target} after the last layer (paper rule)": all(
            r["closed"]["effects"]["paper_rule_alignment"]["rank1"]["abs_min"] >= target - 1e-3 for r in rows),
        "paper claim: the gradient method is feasible with ‖ΔO‖ ≤ closed form (paper rule)": all(
            r["gradient"]["feasible"] and r["gradient"]["norm"] <= r["closed"]["norm"] * (1 + 1e-6) for r in rows),
        "paper claim: in the model's own forward pass the rank-1 edit raises the final alignment |cos| with u": all(
            r["closed"]["effects"]["conditions"]["rank1"]["abs_alignment"]
            > r["closed"]["effects"]["conditions"]["before"]["abs_alignment"] for r in rows),
    }
    checks = {k: bool(v) for k, v in checks.items()}
    return verdict_from(checks), checks


def section_verdict(paper: str, output: str) -> str:
    """The section's one badge from its two verdicts: the same verdict when they agree, the
    measured one when the other is skipped, else partly supported."""
    if paper == output or output == "skipped":
        return paper
    if paper == "skipped":
        return output
    return "partly supported"


def _output_chunk(name: str, ctx) -> dict:
    from ..steering import parse_direction
    model = cached_model(name)
    words = OUTPUT_WORDS[:QUICK_TARGETS] if ctx.quick else OUTPUT_WORDS
    ids = [int(parse_direction(f"token:{w}", model=model).token_id) for w in words]
    res = output_claim_numbers(model, OUTPUT_PROMPTS, ids, steps=QUICK_STEPS if ctx.quick else None, seed=ctx.seed)
    for t, w in zip(res["targets"], words):
        t["word"] = w
    return {"model": name, **res}


def plot_output_claim(per_model: Mapping[str, dict], path, *, title: Optional[str] = None):
    """The frontier of the output claim, one panel per model: each target's worst-prompt
    p(target) against beta (log), one marker per method, filled where the control KL is within
    its bound, hollow where it is not; the dotted line is the level asked for."""
    from matplotlib.figure import Figure
    from ..analysis.plots import save_figure
    names = list(per_model)
    fig = Figure(figsize=(5.2 * max(1, len(names)), 4.4))
    axes = np.atleast_1d(fig.subplots(1, max(1, len(names)), squeeze=False)[0])
    marks = "osD^"
    for ax, name in zip(axes, names):
        for i, method in enumerate(METHODS):
            pts = [(t[method]["beta"], t[method]["min_target_prob"], t[method]["control_kl_mean"] <= MAX_KL + TOLERANCE)
                   for t in per_model[name]["targets"] if "beta" in t[method] and t[method]["beta"] > 0]
            if not pts:
                continue
            b, p, ok = (np.asarray(a) for a in zip(*pts))
            ax.scatter(b[ok], p[ok], marker=marks[i], s=42, color=f"C{i}", label=METHOD_LABELS[method], zorder=3)
            ax.scatter(b[~ok], p[~ok], marker=marks[i], s=42, facecolors="none", edgecolors=f"C{i}", zorder=3,
                       label=None if ok.any() else METHOD_LABELS[method])
        ax.axhline(TARGET_PROB, color="0.5", ls=":", lw=1.0)
        ax.set_xscale("log")
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("β = ‖Δ last-layer output‖_F over the prompts' tokens")
        ax.set_ylabel("p(target), worst prompt")
        ax.set_title(f"{name}: {len(per_model[name]['targets'])} targets", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="best", framealpha=0.85, title=f"hollow: control KL > {MAX_KL}", title_fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return save_figure(fig, path)


def steering_chunks(ctx, name: str):
    """Section 7's chunks of model ``name`` (the default models only): the paper claim's, and
    for the decoders of :data:`OUTPUT_MODELS` the output claim's."""
    chunks = [(f"s7_{name}", functools.partial(_compute, name, ctx))] if name in DEFAULT_MODELS else []
    if name in OUTPUT_MODELS:
        chunks.append((f"s7_output_{name}", functools.partial(_output_chunk, name, ctx)))
    return chunks


def section_steering(ctx) -> SectionResult:
    from ..analysis import plots        # the main process only: workers never load matplotlib
    found, _ = available_models(ctx)
    names = [n for n in DEFAULT_MODELS if n in found]
    rows, outputs = [], {}
    for name in ctx.progress(names, "7 steering"):
        for key, compute in steering_chunks(ctx, name):
            chunk = ctx.model_chunk(name, key, compute)
            if key.startswith("s7_output_"):
                outputs[name] = chunk
            else:
                rows.append(chunk)
    if not rows:
        return SectionResult("steering", "7. Steering", "", "skipped", "None of MiniLM, SmolLM2 and Gemma 3 is installed.")
    figs, table = [], []
    dec = [r for r in rows if "target_prob_mean" in r["closed"]["effects"]["conditions"]["before"]]
    for r in rows:
        figs.append(plots.plot_curve(np.array(r["alpha_curve"]["alpha"]),
                                     {"worst token (paper rule)": np.array(r["alpha_curve"]["min_alignment"])},
                                     ctx.fig(f"s7_{r['model']}_alpha.png"), xlabel="α",
                                     ylabel="min |cos(x_final, u)|",
                                     logx=True, hlines={f"target {TARGET}": TARGET},
                                     title=f"{r['model']}: alignment with u = '{r['word']}' against α"))
        c, g = r["closed"], r["gradient"]
        ce, ge = c["effects"]["conditions"], g["effects"]["conditions"]
        for label, eff, norm in (("closed form", ce, c["norm"]), ("gradient", ge, g["norm"])):
            row = [r["model"], label, norm, eff["rank1"]["abs_alignment"],
                   eff["activation_addition"]["abs_alignment"], eff["before"]["abs_alignment"]]
            if "target_prob_mean" in eff["before"]:
                row += [eff["before"]["target_prob_mean"], eff["rank1"]["target_prob_mean"],
                        eff["activation_addition"]["target_prob_mean"],
                        eff["before"].get("perplexity"), eff["rank1"].get("perplexity"),
                        eff["activation_addition"].get("perplexity")]
            else:
                row += [eff["before"]["pooled_cos_mean"], eff["rank1"]["pooled_cos_mean"],
                        eff["activation_addition"]["pooled_cos_mean"], None, None, None]
            table.append(row)
    for r in dec:
        conds = {"closed form ΔO": r["closed"]["effects"]["conditions"],
                 "gradient ΔO": r["gradient"]["effects"]["conditions"]}
        series = lambda key: {"before": [c["before"][key] for c in conds.values()],
                              "rank-1 edit": [c["rank1"][key] for c in conds.values()],
                              "activation addition (equal change)": [c["activation_addition"][key]
                                                                     for c in conds.values()]}
        figs.append(plots.plot_group_bars(list(conds), series("target_prob_mean"),
                                          ctx.fig(f"s7_{r['model']}_target_prob.png"), logy=True,
                                          ylabel=f"P('{r['token']}'), mean over prompts",
                                          title=f"{r['model']}: probability of the target token"))
        figs.append(plots.plot_group_bars(list(conds), series("perplexity"),
                                          ctx.fig(f"s7_{r['model']}_perplexity.png"), logy=True,
                                          ylabel="perplexity on neutral sentences",
                                          title=f"{r['model']}: the cost of steering"))
    paper_verdict, checks = paper_claim_verdict(rows)
    parts = []
    for r in rows:
        c, g = r["closed"], r["gradient"]
        ce = c["effects"]["conditions"]
        s = (f"{r['model']} (u = '{r['word']}'): α = {c['alpha']:.3g} (‖ΔO‖ = {c['norm']:.3g}) puts every token at "
             f"|cos| ≥ {TARGET} under the paper rule; the gradient method reaches it with ‖ΔO‖ = {g['norm']:.3g} "
             f"({g['norm'] / c['norm']:.0%} of the closed form). u becomes principal from α = "
             f"{r['principal_alpha']['alpha']:.3g}. In the model's own forward pass the final alignment |cos| goes "
             f"{ce['before']['abs_alignment']:.3f} → {ce['rank1']['abs_alignment']:.3f} (rank-1) vs "
             f"{ce['activation_addition']['abs_alignment']:.3f} (activation addition, equal change norm)")
        if "target_prob_mean" in ce["before"]:
            s += (f"; P('{r['token']}') {ce['before']['target_prob_mean']:.3f} → {ce['rank1']['target_prob_mean']:.3f} "
                  f"(rank-1) vs {ce['activation_addition']['target_prob_mean']:.3f} (activation addition), perplexity "
                  f"{ce['before']['perplexity']:.4g} → {ce['rank1']['perplexity']:.4g} vs "
                  f"{ce['activation_addition']['perplexity']:.4g}")
        parts.append(s)
    cols = ["model", "method", "‖ΔO‖", "align. rank-1 (full)", "align. act.-add.", "align. before",
            "P(target)/pooled cos before", "rank-1", "act.-add.", "ppl before", "ppl rank-1", "ppl act.-add."]
    tables = [Table("Paper claim: closed form vs gradient vs activation addition", cols, table)]
    summaries = {name: {m: method_summary(o["targets"], m) for m in METHODS} for name, o in outputs.items()}
    output_verdict, output_checks = output_claim_verdict(
        {name: {m: s["share"] for m, s in by.items()} for name, by in summaries.items()})
    checks.update(output_checks)
    summary = (f"Paper claim: {paper_verdict}. " + ". ".join(parts) + ". "
               + output_claim_text(outputs, summaries, output_verdict, quick=ctx.quick))
    if outputs:
        figs.append(plot_output_claim(outputs, ctx.fig("s7_output_frontier.png"),
                                      title="Output claim: each target's worst-prompt p(target) against β, per method"))
        tables.append(Table(f"Output claim: p(target) ≥ {TARGET_PROB} at every prompt with control KL ≤ {MAX_KL}",
                            ["model", "method", "targets reached", "share", "median β (reached)", "median β (all)",
                             "median worst-prompt p", "median control KL", "median ‖edit‖ (reached)"],
                            [[name, METHOD_LABELS[m], f"{s['reached']}/{s['targets']}" + (
                                f" ({s['targets'] - s['reached']} not reached)" if s["reached"] < s["targets"] else ""),
                              s["share"],
                              s["median_beta_reached"], s["median_beta"], s["median_min_target_prob"],
                              s["median_control_kl"], s["median_delta_norm_reached"]]
                             for name, by in summaries.items() for m, s in by.items()]))
    verdicts = {"paper_claim": paper_verdict, "output_claim": output_verdict}
    return SectionResult("steering", "7. Steering with a rank-1 change of the last layer",
                         "Paper claim: a large enough rank-1 perturbation of the last layer's output matrix opens a "
                         "large spectral gap with a chosen principal eigenvector, and the tokens align with it almost "
                         "perfectly, whatever the architecture. Output claim (what a steering user wants): the edit "
                         "makes a chosen token the model's own next token without large side effects.",
                         section_verdict(paper_verdict, output_verdict), summary,
                         {"per_model": rows, "output_claim": {name: {**o, "summary": summaries[name]}
                                                              for name, o in outputs.items()},
                          "verdicts": verdicts, "checks": checks}, figs, tables)


def output_claim_text(outputs: Mapping[str, dict], summaries: Mapping[str, dict], verdict: str, *,
                      quick: bool) -> str:
    """The output claim's paragraph of the summary, from its numbers."""
    if not outputs:
        return "Output claim: skipped (neither SmolLM2 nor Gemma 3 is installed)."
    any_row = next(iter(outputs.values()))
    k, steps = len(any_row["targets"]), any_row["steps"]
    s = (f"Output claim: {verdict} (threshold: the gradient ΔO or activation addition reaches p(target) ≥ "
         f"{TARGET_PROB} at each of the {len(any_row['prompts'])} prompts with mean control KL ≤ {MAX_KL} for ≥ "
         f"{SHARE_NEEDED:.0%} of the {k} targets, on every model; "
         + (f"--quick: {k} targets and {steps} Adam steps per target, the full run uses {len(OUTPUT_WORDS)} and the "
               f"optimiser's default" if quick and steps
            else "the optimiser's default Adam steps") + "). ")
    per = []
    for name, by in summaries.items():
        items = []
        for m in METHODS:
            x = by[m]
            beta = (f", median β {x['median_beta_reached']:.3g}" if x["median_beta_reached"] is not None else "")
            items.append(f"{METHOD_LABELS[m]} {x['reached']}/{x['targets']}{beta}")
        per.append(f"{name}: " + "; ".join(items))
    return s + ". ".join(per) + "."


section_steering.title = "7. Steering with a rank-1 change of the last layer"
section_steering.model_chunks = steering_chunks
SECTIONS = [section_steering]
