"""Sections 1-4: the paper's shared-weight claims on synthetic systems, each a sweep spec.

1. strictly dominant real eigenvalue: consensus at rate 1/|1+lambda1|, direction -> v1
   at rate |1+lambda2|/|1+lambda1|, over a sweep of spectra;
2. dominant complex pair: a rotating consensus (limit cycle) in span(Re v1, Im v1),
   rotation per step arg(1 + lambda1);
3. close top eigenvalues: fast convergence into span(v1, v2), slow toward v1;
4. bipartite consensus: the fraction of near-bipartite starts that stay bipartite,
   against heads and beta, over >= 1000 systems.

Each section is a spec in ``powerlens/_src/reproduce/specs/`` of the built-in synthetic builder
(:func:`powerlens._src.dynamics.synthetic.synthetic`), run by the sweep engine
(:mod:`powerlens._src.sweeps.engine`) into reproduce's chunk store; ``--quick`` and ``--seed``
override its grid, replicates and seed (:func:`section_spec`). Every row is therefore
rebuilt from its ``seed`` and grid values alone:
``pl.sweep_system(section_spec(name, seed=S, quick=Q), row)``. The sections read the
engine's columns only. The laws, in the builder's terms:

1. ``top`` = [1, 3], ``rest`` = [-0.3, hi] for hi in 0.3, 0.5, 0.7, 0.85 (a grid axis),
   symmetric F: lambda2 (the largest of the 15 others, about hi) over lambda1 spreads over
   0.1 .. 0.85. The builder draws the others from one range, independently of lambda1, so
   lambda3 lies close to lambda2 (a law such as lambda2 = lambda1 U(0.3, 0.85) with the rest
   U(-0.3, 0.3) lambda2 is not one it can express).
2. ``pair`` = 1, ``top`` = [0.5, 1.5] (Re lambda1), ``imag`` = [0.3, 2.5], ``rest`` =
   [-0.3, 0.3]: 1 + lambda1 lies in a box of modulus 1.5 .. 3.5 and argument 0.12 .. 1.03 rad
   (the builder draws the real and imaginary parts, not the modulus and the argument).
3. one explicit spectrum per gap (0.2, 0.1, 0.05, 0.02): 2, 2 - gap, 0.5 and 13 fixed values
   spread over [-0.3, 0.1] (a spectrum text has fixed entries, not draws); v1 and
   span(v1, v2) are the builder's ``direction`` and ``top2`` facts.
4. ``top`` = [1, 3], ``rest`` = [-0.5, 0.5], symmetric, ``init = "bipartite"`` with
   ``noise`` 0.02; the exact +-v1 start is the builder's ``x0_exact``; float64, so that the
   exact start of a one-head system is a fixed point to rounding.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np

from ..dynamics.measures import wrap_angle
from ..dynamics.synthetic import parse_spectrum
from ..sweeps.columns import fit_rates
from ..sweeps.engine import run_sweep
from ..sweeps.spec import load_spec, read_toml
from .section import SectionResult, Table, verdict_from

SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "specs")


def fit_rate(values, lo: float, hi: float, min_points: int = 3) -> float:
    """exp(slope) of log(values) over the steps where lo < value < hi (NaN if too few)."""
    return float(fit_rates(np.asarray(values, float)[None], (lo, hi), min_points=min_points)[0])


def section_spec_path(name: str) -> str:
    """The spec file of section spec ``name`` (``specs/NAME.toml``)."""
    return os.path.join(SPECS, name + ".toml")


def spectrum_gap(text: str) -> float:
    """lambda1 - lambda2 of an explicit spectrum text (its first two entries), to 1e-9."""
    z = parse_spectrum(text)
    return round(z[0].real - z[1].real, 9)


QUICK_GAPS = (0.2, 0.1, 0.05)
"""Section 3's gaps lambda1 - lambda2 in a ``--quick`` run (the spec's spectra with these gaps)."""
SPEC_NAMES = ("dominant_real", "complex_pair", "close_eigenvalues", "bipartite")


def quick_overrides(name: str) -> dict:
    """What ``--quick`` changes in section spec ``name`` (one of :data:`SPEC_NAMES`): fewer
    grid values and replicates."""
    if name == "dominant_real":
        return {"grid": {"rest": [[-0.3, 0.3], [-0.3, 0.85]]}, "system": {"replicates": 4}}
    if name == "complex_pair":
        return {"system": {"replicates": 4}}
    if name == "close_eigenvalues":
        spectra = read_toml(section_spec_path(name))["grid"]["spectrum"]
        return {"grid": {"spectrum": [s for s in spectra if spectrum_gap(s) in QUICK_GAPS]},
                "system": {"replicates": 2}, "run": {"chunk_size": 2}}
    if name == "bipartite":
        return {"grid": {"heads": [1, 4]}, "system": {"replicates": 16}, "run": {"chunk_size": 16}}
    raise ValueError(f"unknown section spec {name!r}; expected one of {', '.join(SPEC_NAMES)}")


def section_spec(name: str, *, seed: int = 0, quick: bool = False):
    """The :class:`~powerlens._src.sweeps.spec.Spec` of section ``name`` as ``powerlens reproduce
    [--quick] --seed SEED`` runs it: ``pl.sweep_system(section_spec(name, seed=S, quick=Q), row)``
    rebuilds any row of its table."""
    overrides = quick_overrides(name)
    return load_spec(section_spec_path(name), overrides={"seed": seed, **(overrides if quick else {})})


def run_section(ctx, name: str, desc: str):
    """(spec, table) of section spec ``name`` with the run's seed and ``--quick``, run into
    reproduce's store."""
    spec = section_spec(name, seed=ctx.seed, quick=ctx.quick)
    return spec, run_sweep(spec, ctx.store, progress=ctx.show_progress, desc=desc, prefix=name + "-").table


def finite_or_none(v):
    """``v`` as a float for results.json, or None when it is None, NaN or infinite."""
    return None if v is None or not np.isfinite(v) else float(v)


# --------------------------------------------------------------------------- section 1

def section_dominant_real(ctx) -> SectionResult:
    from ..analysis import plots        # the main process only: workers never load matplotlib
    spec, df = run_section(ctx, "dominant_real", "1 dominant real")
    d = spec.system["d"]
    rows = [{"lambda1": r.lambda1_re, "lambda2": r.lambda2_re, "pred_consensus_rate": r.consensus_rate_pred,
             "pred_direction_rate": r.direction_rate_pred, "meas_consensus_rate": finite_or_none(r.consensus_rate),
             "meas_direction_rate": finite_or_none(r.direction_rate), "final_gamma": r.final_gamma,
             "consensus": r.consensus if i == 0 else None} for i, r in enumerate(df.itertuples())]
    pc = np.array([r["pred_consensus_rate"] for r in rows])
    mc = np.array([np.nan if r["meas_consensus_rate"] is None else r["meas_consensus_rate"] for r in rows])
    pd = np.array([r["pred_direction_rate"] for r in rows])
    md = np.array([np.nan if r["meas_direction_rate"] is None else r["meas_direction_rate"] for r in rows])
    gam = np.array([r["final_gamma"] for r in rows])
    err_c = np.nanmedian(np.abs(mc - pc) / pc)
    err_d = np.nanmedian(np.abs(md - pd) / pd)
    figs = [
        plots.plot_scatter_predicted(pc, mc, ctx.fig("s1_consensus_rate.png"),
                                     xlabel="predicted consensus rate 1/|1+λ1|",
                                     ylabel="measured rate μ(t+1)/μ(t)",
                                     title="Consensus rate over a sweep of spectra"),
        plots.plot_scatter_predicted(pd, md, ctx.fig("s1_direction_rate.png"),
                                     xlabel="predicted |1+λ2|/|1+λ1|",
                                     ylabel="measured rate of tan∠(x̄, v1)",
                                     title="Convergence of the common direction to v1"),
        plots.plot_consensus(np.array(rows[0]["consensus"])[:60], ctx.fig("s1_consensus_example.png"),
                             predicted_rate=rows[0]["pred_consensus_rate"], fit_start=5,
                             title=f"Consensus, λ1={rows[0]['lambda1']:.2f} (softmax, 2 heads)"),
    ]
    checks = {"consensus rate within 5% (median)": bool(err_c < 0.05),
              "direction rate within 5% (median)": bool(err_d < 0.05),
              "final alignment with v1 > 0.99 for every system": bool(np.all(gam > 0.99))}
    numbers = {"systems": len(rows), "median_rel_error_consensus_rate": err_c,
               "median_rel_error_direction_rate": err_d, "min_final_gamma": float(gam.min()),
               "checks": checks, "per_system": [{k: v for k, v in r.items() if k != "consensus"} for r in rows]}
    table = Table("Predicted vs measured rates (first 8 systems)",
                  ["λ1", "λ2", "1/|1+λ1|", "measured", "|1+λ2|/|1+λ1|", "measured", "final γ"],
                  [[r["lambda1"], r["lambda2"], r["pred_consensus_rate"], r["meas_consensus_rate"],
                    r["pred_direction_rate"], r["meas_direction_rate"], r["final_gamma"]] for r in rows[:8]])
    summary = (f"Over {len(rows)} symmetric systems (d={d}, 2 softmax heads), the consensus rate matches "
               f"1/|1+λ1| with median relative error {err_c:.2%} and the direction rate matches |1+λ2|/|1+λ1| "
               f"with median relative error {err_d:.2%}; the final alignment with v1 is at least {gam.min():.4f}.")
    return SectionResult("dominant_real", "1. Shared weights, strictly dominant real eigenvalue",
                         "With a strictly dominant real eigenvalue, the tokens reach a consensus aligned with ±v1.",
                         verdict_from(checks), summary, numbers, figs, [table])


# --------------------------------------------------------------------------- section 2

def section_complex_pair(ctx) -> SectionResult:
    from ..analysis import plots        # the main process only: workers never load matplotlib
    _, df = run_section(ctx, "complex_pair", "2 complex pair")
    rows = [{"kind": r.kind, "lambda1": [r.lambda1_re, r.lambda1_im], "pred_rotation": r.rotation_pred,
             "meas_rotation": r.rotation, "plane_dim": int(r.principal_dim), "final_gamma_plane": r.final_gamma,
             "final_consensus": r.final_consensus,
             "plane_angles": np.asarray(r.plane_angle)[-40:] if i == 0 else None} for i, r in enumerate(df.itertuples())]
    pred = np.array([r["pred_rotation"] for r in rows])
    meas = np.array([r["meas_rotation"] for r in rows])
    gp = np.array([r["final_gamma_plane"] for r in rows])
    cons = np.array([r["final_consensus"] for r in rows])
    normal = np.array([r["kind"] == "normal" for r in rows])
    err = np.abs(wrap_angle(meas - pred))          # angles: pi - 0.001 and -pi + 0.001 are 0.002 apart
    angles = rows[0]["plane_angles"]                 # (40, n): each token's angle in the plane
    figs = [
        plots.plot_scatter_predicted(pred, meas, ctx.fig("s2_rotation.png"), xlabel="predicted arg(1+λ1) [rad/step]",
                                     ylabel="measured rotation [rad/step]",
                                     title="Rotation per step in the principal plane", angles=True),
        plots.plot_curve(np.arange(angles.shape[0]), {f"token {j}": angles[:, j] for j in range(min(4, angles.shape[1]))},
                         ctx.fig("s2_phase.png"), xlabel="step (last 40)", ylabel="angle in the plane [rad]",
                         title="Tokens rotate together (limit cycle in the plane)"),
    ]
    checks = {"rotation within 0.01 rad (normal F)": bool(np.max(err[normal]) < 0.01),
              "rotation within 0.05 rad (non-normal F)": bool(np.max(err[~normal]) < 0.05),
              "tokens stay in the principal plane (γ > 0.99)": bool(np.all(gp > 0.99)),
              "tokens reach a (rotating) consensus (μ < 1e-3)": bool(np.all(cons < 1e-3))}
    numbers = {"systems": len(rows), "max_abs_error_normal": float(np.max(err[normal])),
               "max_abs_error_nonnormal": float(np.max(err[~normal])), "min_gamma_plane": float(gp.min()),
               "max_final_consensus": float(cons.max()), "checks": checks,
               "per_system": [{k: v for k, v in r.items() if k != "plane_angles"} for r in rows]}
    table = Table("Rotation per step (first 8 systems)", ["kind", "λ1", "arg(1+λ1)", "measured", "γ plane"],
                  [[r["kind"], f"{r['lambda1'][0]:.3f}{r['lambda1'][1]:+.3f}j", r["pred_rotation"], r["meas_rotation"],
                    r["final_gamma_plane"]] for r in rows[:8]])
    summary = (f"Over {len(rows)} systems with a dominant complex pair, the tokens converge to a rotating consensus "
               f"in span(Re v1, Im v1) (γ ≥ {gp.min():.4f}); the rotation per step matches arg(1+λ1), not arg λ1, "
               f"within {np.max(err[normal]):.2e} rad (normal F) and {np.max(err[~normal]):.2e} rad (non-normal F).")
    return SectionResult("complex_pair", "2. Dominant complex pair: a limit cycle",
                         "With a dominant complex pair, tokens settle into a limit cycle in span(Re v1, Im v1).",
                         verdict_from(checks), summary, numbers, figs, [table])


# --------------------------------------------------------------------------- section 3


def section_close_eigenvalues(ctx) -> SectionResult:
    from ..analysis import plots        # the main process only: workers never load matplotlib
    _, df = run_section(ctx, "close_eigenvalues", "3 close eigenvalues")
    gap = [spectrum_gap(s) for s in df["spectrum"]]
    gaps = list(dict.fromkeys(gap))
    rows = [{"gap": g, "pred_slow": r.direction_rate_pred, "pred_fast": r.top2_rate_pred,
             "meas_slow": finite_or_none(r.direction_rate), "meas_fast": finite_or_none(r.top2_rate),
             "tan_v1": r.direction_tan if r.replicate == 0 else None,
             "tan_plane": r.top2_tan if r.replicate == 0 else None} for g, r in zip(gap, df.itertuples())]
    nan = lambda v: np.nan if v is None else v
    ps, ms = np.array([r["pred_slow"] for r in rows]), np.array([nan(r["meas_slow"]) for r in rows])
    pf, mf = np.array([r["pred_fast"] for r in rows]), np.array([nan(r["meas_fast"]) for r in rows])
    ex = next(r for r in rows if r["tan_v1"] is not None and r["gap"] == gaps[-1])
    figs = [plots.plot_curve(np.arange(len(ex["tan_v1"])), {"tan∠(x̄, v1)": np.array(ex["tan_v1"]),
                                                            "tan∠(x̄, span(v1,v2))": np.array(ex["tan_plane"])},
                             ctx.fig("s3_two_speeds.png"), xlabel="step t", ylabel="tan of the angle", logy=True,
                             title=f"Close top eigenvalues (λ1=2, λ2={2 - ex['gap']:.2f}): two speeds")]
    rel = lambda m, p: np.abs(m - p) / p
    checks = {"fast rate into span(v1,v2) matches |1+λ3|/|1+λ1| within 5%": bool(np.nanmax(rel(mf, pf)) < 0.05),
              "slow rate toward v1 matches |1+λ2|/|1+λ1| within 2%": bool(np.nanmax(rel(ms, ps)) < 0.02),
              "fast is faster than slow in every system": bool(np.all(mf < ms))}
    numbers = {"systems": len(rows), "checks": checks,
               "per_system": [{k: v for k, v in r.items() if not k.startswith("tan")} for r in rows]}
    table = Table("Two speeds", ["λ1-λ2", "|1+λ2|/|1+λ1|", "measured slow", "|1+λ3|/|1+λ1|", "measured fast"],
                  [[r["gap"], r["pred_slow"], r["meas_slow"], r["pred_fast"], r["meas_fast"]] for r in rows])
    summary = (f"With λ1=2 and λ2 within {max(gaps)} of it, the common direction enters span(v1, v2) at rate "
               f"|1+λ3|/|1+λ1| (max rel. error {np.nanmax(rel(mf, pf)):.1%}) and turns toward v1 only at rate "
               f"|1+λ2|/|1+λ1| (max rel. error {np.nanmax(rel(ms, ps)):.1%}), as the ALBERT-base/large analysis says. "
               f"(The out-of-plane part decays relative to the in-plane norm, which grows like |1+λ1|^t, hence "
               f"|1+λ3|/|1+λ1| rather than |1+λ3|/|1+λ2|.)")
    return SectionResult("close_eigenvalues", "3. Close top eigenvalues (ALBERT-base/large-like)",
                         "With λ1 close to λ2, tokens converge into span(v1, v2) fast and toward v1 slowly.",
                         verdict_from(checks), summary, numbers, figs, [table])


# --------------------------------------------------------------------------- section 4

def section_bipartite(ctx) -> SectionResult:
    from ..analysis import plots        # the main process only: workers never load matplotlib
    from ..analysis.measures import binomial_interval
    _, df = run_section(ctx, "bipartite", "4 bipartite")
    heads_list = sorted(set(df["heads"].tolist()))
    betas = sorted(set(df["beta"].tolist()))
    cells = [{"heads": int(sub["heads"].iloc[0]), "beta": float(sub["beta"].iloc[0]), "systems": int(len(sub)),
              "fraction_bipartite": float(sub["bipartite_final"].astype(float).mean()),
              "median_off_line": float(np.median(sub["bipartite_drift"].to_numpy(float)))}
             for _, sub in df.groupby("point", sort=True)]
    frac = {H: np.array([c["fraction_bipartite"] for c in cells if c["heads"] == H]) for H in heads_list}
    res = {H: np.array([c["median_off_line"] for c in cells if c["heads"] == H]) for H in heads_list}
    total = sum(c["systems"] for c in cells)
    label = lambda H: f"{H} head{'s' if H > 1 else ''}"
    # each cell's fraction is k bipartite systems out of N independent ones: its Wilson 95 % interval
    intervals = {label(H): binomial_interval([round(c["fraction_bipartite"] * c["systems"]) for c in cells
                                              if c["heads"] == H], [c["systems"] for c in cells if c["heads"] == H])
                 for H in heads_list}
    figs = [plots.plot_curve(np.array(betas), {label(H): frac[H] for H in heads_list},
                             ctx.fig("s4_bipartite.png"), xlabel="inverse temperature β",
                             ylabel="fraction still bipartite after 60 steps",
                             title=f"Near-bipartite starts (±v1 + noise), {total} systems",
                             intervals=intervals, interval_label="95 % binomial interval", ylim=(0.0, 1.05))]
    one_head = float(frac[1].mean())
    several = float(np.mean([frac[H].mean() for H in heads_list[1:]]))
    checks = {"one head keeps more bipartite starts than several heads": bool(one_head > several),
              "one head: the exact ±v1 configuration stays on the line of v1 (fixed up to sign)": bool(
                  np.max(res[1]) < 1e-4),
              "several heads: it leaves the line of v1 (median distance > 1e-3)": bool(
                  np.min([res[H].min() for H in heads_list[1:]]) > 1e-3)}
    if not ctx.quick:
        checks["sweep of at least 1000 systems"] = bool(total >= 1000)
    numbers = {"systems": total, "fraction_one_head": one_head, "fraction_several_heads": several,
               "cells": cells, "checks": checks}
    table = Table("Fraction still bipartite", ["heads"] + [f"β={b}" for b in betas],
                  [[H] + frac[H].tolist() for H in heads_list])
    summary = (f"Over {total} systems, {one_head:.0%} of near-bipartite starts stay bipartite with one head and "
               f"{several:.0%} with several heads (mean over β). One step from the exact ±v1 configuration, the tokens "
               f"stay within {np.max(res[1]):.1e} of the line of v1 with one head (a fixed point, up to a sign flip when "
               f"1 + λ1 s_i m_i < 0) and leave it by at least {np.min([res[H].min() for H in heads_list[1:]]):.1e} "
               f"(median) with several heads." + ("" if not ctx.quick else " (--quick: a smaller sweep.)"))
    return SectionResult("bipartite", "4. Bipartite consensus",
                         "Bipartite consensus exists in theory but is rare and unstable with several heads.",
                         verdict_from(checks), summary, numbers, figs, [table])


section_dominant_real.title = "1. Shared weights, strictly dominant real eigenvalue"
section_complex_pair.title = "2. Dominant complex pair: a limit cycle"
section_close_eigenvalues.title = "3. Close top eigenvalues (ALBERT-base/large-like)"
section_bipartite.title = "4. Bipartite consensus"
SECTIONS = [section_dominant_real, section_complex_pair, section_close_eigenvalues, section_bipartite]
