"""Section 7: steering the last layer toward a chosen direction u, on MiniLM, SmolLM2 and Gemma 3.

For each model and its token direction u (the unembedding row of a word):
  closed form   O' = O + alpha u w^T, w = V u/||V u||, alpha the smallest value that puts
                every token at cos >= c after the last layer (exact one-step relation);
  gradient      optax, min ||dO||_F (rank 1) subject to the same worst-token alignment;
  activation    add beta u to the last layer's output, beta = the mean norm of the change
  addition      the rank-1 edit makes there (equal change norm).
The spectral claim is checked on F': the steered eigenvalue is principal (shifted
ordering) and its eigenvector is close to u.
"""
from __future__ import annotations

import functools

import numpy as np

from .real_models import DEFAULT_MODELS, _load, _prompts, available_models
from .section import SectionResult, Table, verdict_from

WORDS = {"minilm": "king", "smollm2": "Paris", "gemma3": "Paris"}
TARGET = 0.9
NEUTRAL = ["The weather was mild and the streets were quiet.",
           "He read the report twice before he signed it."]


def _compute(name: str, ctx) -> dict:
    from ..models import embed
    from ..steering import minimal_alpha, optimize_steering, output_effects, parse_direction, rank1
    model = _load(name)
    texts = _prompts(ctx)
    x0, valid = embed(model, texts)
    x0, valid = np.asarray(x0), np.asarray(valid)
    direction = parse_direction(f"token:{WORDS[name]}", model=model)
    u = direction.vector
    layers = model.layers
    m = minimal_alpha(layers, u, x0, valid=valid, target=TARGET, w="value", signed=False)
    alpha = m.alignment.alpha
    r1 = rank1(layers, u, alpha=alpha, w="value")
    spec = m.principal                     # (a) spectral, computed by minimal_alpha with the same w and cos_tol
    opt = optimize_steering(layers, x0, u, valid=valid, target=TARGET, reduce="min", param="lowrank", rank=1,
                            w="value", steps=150 if ctx.quick else 300, seed=ctx.seed, signed=False)
    neutral = NEUTRAL if model.info.decoder else None
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


def steering_chunks(ctx, name: str):
    """Section 7's chunks of model ``name`` (the default models only)."""
    return [(f"s7_{name}", functools.partial(_compute, name, ctx))] if name in DEFAULT_MODELS else []


def section_steering(ctx) -> SectionResult:
    from ..analysis import plots        # the main process only: workers never load matplotlib
    found, _ = available_models(ctx)
    names = [n for n in DEFAULT_MODELS if n in found]
    rows = []
    for name in ctx.progress(names, "7 steering"):
        (key, compute), = steering_chunks(ctx, name)
        rows.append(ctx.model_chunk(name, key, compute))
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
    checks = {
        "the steered eigenvalue becomes principal with an eigenvector close to u (|cos| ≥ 0.95)": all(
            r["principal_alpha"]["cos"] >= 0.95 for r in rows),
        f"closed form: every token reaches |cos| ≥ {TARGET} after the last layer (paper rule)": all(
            r["closed"]["effects"]["paper_rule_alignment"]["rank1"]["abs_min"] >= TARGET - 1e-3 for r in rows),
        "gradient: feasible with ‖ΔO‖ ≤ closed form": all(
            r["gradient"]["feasible"] and r["gradient"]["norm"] <= r["closed"]["norm"] * (1 + 1e-6) for r in rows),
        "in the model's own forward pass the rank-1 edit raises the final alignment |cos| with u": all(
            r["closed"]["effects"]["conditions"]["rank1"]["abs_alignment"]
            > r["closed"]["effects"]["conditions"]["before"]["abs_alignment"] for r in rows),
    }
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
    return SectionResult("steering", "7. Steering with a rank-1 change of the last layer",
                         "A large enough rank-1 perturbation of the last layer's output matrix opens a large spectral "
                         "gap with a chosen principal eigenvector, and the tokens align with it almost perfectly, "
                         "whatever the architecture.", verdict_from({k: bool(v) for k, v in checks.items()}),
                         ". ".join(parts) + ".", {"per_model": rows, "checks": {k: bool(v) for k, v in checks.items()}},
                         figs, [Table("Closed form vs gradient vs activation addition", cols, table)])


section_steering.title = "7. Steering with a rank-1 change of the last layer"
section_steering.model_chunks = steering_chunks
SECTIONS = [section_steering]
