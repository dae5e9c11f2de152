"""Sections 1-4: the paper's shared-weight claims on synthetic systems.

1. strictly dominant real eigenvalue: consensus at rate 1/|1+lambda1|, direction -> v1
   at rate |1+lambda2|/|1+lambda1|, over a sweep of spectra;
2. dominant complex pair: a rotating consensus (limit cycle) in span(Re v1, Im v1),
   rotation per step arg(1 + lambda1);
3. close top eigenvalues: fast convergence into span(v1, v2), slow toward v1;
4. bipartite consensus: the fraction of near-bipartite starts that stay bipartite,
   against heads and beta, over >= 1000 systems.
"""
from __future__ import annotations


import jax
import numpy as np

from ..analysis import plots
from ..analysis.spectra import sweep_subspaces
from ..dynamics.params import layer_matrices
from ..dynamics.sweep import simulate_sweep, stack_systems
from ..dynamics.synthetic import bipartite_tokens, cone_tokens, spectrum_matrix, synthetic_system
from .section import SectionResult, Table, verdict_from


def fit_rate(values, lo: float, hi: float, min_points: int = 3) -> float:
    """exp(slope) of log(values) over the steps where lo < value < hi (NaN if too few)."""
    v = np.asarray(values, float)
    t = np.arange(len(v))
    ok = np.isfinite(v) & (v > lo) & (v < hi)
    if ok.sum() < min_points:
        return float("nan")
    slope = np.polyfit(t[ok], np.log(v[ok]), 1)[0]
    return float(np.exp(slope))


def _mean_direction_tan(states, basis):
    """tan of the angle between the token mean and a subspace (orthonormal basis (d, k)), per step."""
    m = states.mean(axis=-2)                       # (T+1, d)
    p = m @ basis
    par = np.linalg.norm(p, axis=-1)
    perp = np.linalg.norm(m - p @ basis.T, axis=-1)
    return perp / np.maximum(par, 1e-300)


def _systems(spectra_list, *, kind, heads, beta, d, seed, steps, dtype=np.float64):
    return [synthetic_system(s, kind=kind, heads=heads, beta=beta, d=d, seed=seed + i, steps=steps, dtype=dtype)
            for i, s in enumerate(spectra_list)]


def _sweep_states(systems, n_tokens, seed, *, attention="softmax", cone=0.5):
    """Simulate every system from tokens in a cone of half-angle ``cone`` rad around a random axis.

    Starting inside an open hemisphere is the standard condition for consensus; from a
    spread start a softmax system can also settle into bipartite or periodic states.
    """
    spectra, subs = sweep_subspaces(systems, seed=seed)
    d = systems[0].config.d_model
    rng = np.random.default_rng(seed)
    X0 = np.stack([cone_tokens(rng, n_tokens, rng.standard_normal(d), rng.uniform(0, cone, n_tokens)[:, None])
                   for _ in systems])
    traj = simulate_sweep(stack_systems(systems), X0, subs, attention=attention, save_states=True)
    return spectra, jax.tree_util.tree_map(np.asarray, traj)


# --------------------------------------------------------------------------- section 1

def section_dominant_real(ctx) -> SectionResult:
    S = 8 if ctx.quick else 64
    d, n, T = 16, 16, 250

    def chunk(c):
        r = np.random.default_rng(ctx.seed * 1000 + c)
        specs = []
        for _ in range(4):
            lam1 = r.uniform(1.0, 3.0)
            lam2 = lam1 * r.uniform(0.3, 0.85)
            rest = r.uniform(-0.3, 0.3, d - 2) * lam2
            specs.append([lam1, lam2] + list(rest))
        systems = _systems(specs, kind="symmetric", heads=2, beta=1.0, d=d, seed=ctx.seed * 1000 + 10 * c, steps=T)
        spectra, traj = _sweep_states(systems, n, ctx.seed + c)
        P = traj.index("principal")
        out = []
        for i, sp in enumerate(spectra):
            s = sp[0].shifted
            states = np.asarray(traj.states[i], float)
            mu = np.asarray(traj.consensus[i], float)
            tan = _mean_direction_tan(states, s.basis)
            out.append({"lambda1": s.top.real, "lambda2": s.eigenvalues[1].real,
                        "pred_consensus_rate": 1.0 / s.mu1, "pred_direction_rate": s.ratio,
                        "meas_consensus_rate": fit_rate(mu, 1e-11, 1e-4),
                        "meas_direction_rate": fit_rate(tan, 1e-11, 1e-4),
                        "final_gamma": float(np.asarray(traj.gamma[i, -1, P])),
                        "consensus": mu.tolist() if (c == 0 and i == 0) else None})
        return out

    rows = []
    with jax.enable_x64(True):
        for c in ctx.progress(range(S // 4), "1 dominant real"):
            rows += ctx.store.cached(f"s1_chunk{c}", lambda c=c: chunk(c))
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
    S = 4 if ctx.quick else 32
    d, n, T = 16, 16, 160

    def chunk(c, kind):
        r = np.random.default_rng(ctx.seed * 2000 + c + (0 if kind == "normal" else 500))
        specs, phis = [], []
        for _ in range(4):
            rho, phi = r.uniform(2.0, 3.0), r.uniform(0.1, 1.2)
            lam = complex(rho * np.cos(phi) - 1.0, rho * np.sin(phi))
            rest = list(r.uniform(-0.3, 0.3, d - 2))
            specs.append([lam] + rest)
            phis.append(phi)
        systems = _systems(specs, kind=kind, heads=2, beta=1.0, d=d, seed=ctx.seed * 2000 + 10 * c, steps=T)
        spectra, traj = _sweep_states(systems, n, ctx.seed + 7 * c)
        P = traj.index("principal")
        out = []
        K = 60
        for i, sp in enumerate(spectra):
            s = sp[0].shifted
            rot = np.asarray(traj.rotation[i], float)
            out.append({"kind": kind, "lambda1": [s.top.real, s.top.imag], "pred_rotation": float(np.angle(1 + s.top)),
                        "meas_rotation": float(np.sum(rot[-K:]) / K), "plane_dim": s.dim,
                        "final_gamma_plane": float(np.asarray(traj.gamma[i, -1, P])),
                        "final_consensus": float(np.asarray(traj.consensus[i, -1])),
                        "plane_states": (np.asarray(traj.states[i], float)[-40:, :8] @ s.basis).tolist()
                        if (c == 0 and i == 0) else None})
        return out

    rows = []
    with jax.enable_x64(True):
        for kind in ("normal", "nonnormal"):
            for c in ctx.progress(range(S // 4), f"2 complex pair ({kind})"):
                rows += ctx.store.cached(f"s2_{kind}_chunk{c}", lambda c=c, kind=kind: chunk(c, kind))
    pred = np.array([r["pred_rotation"] for r in rows])
    meas = np.array([r["meas_rotation"] for r in rows])
    gp = np.array([r["final_gamma_plane"] for r in rows])
    cons = np.array([r["final_consensus"] for r in rows])
    normal = np.array([r["kind"] == "normal" for r in rows])
    err = np.abs(meas - pred)
    coords = np.array(rows[0]["plane_states"])       # (40, 8, 2)
    figs = [
        plots.plot_scatter_predicted(pred, meas, ctx.fig("s2_rotation.png"), xlabel="predicted arg(1+λ1) [rad/step]",
                                     ylabel="measured rotation [rad/step]",
                                     title="Rotation per step in the principal plane"),
        plots.plot_curve(np.arange(coords.shape[0]), {f"token {j}": np.arctan2(coords[:, j, 1], coords[:, j, 0])
                                                      for j in range(min(4, coords.shape[1]))},
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
               "per_system": [{k: v for k, v in r.items() if k != "plane_states"} for r in rows]}
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
    d, n, T = 16, 16, 700
    gaps = [0.2, 0.1, 0.05] if ctx.quick else [0.3, 0.25, 0.2, 0.15, 0.1, 0.075, 0.05, 0.03]

    def chunk(g):
        specs = []
        r = np.random.default_rng(ctx.seed * 3000 + int(1000 * g))
        for _ in range(2):
            specs.append([2.0, 2.0 - g, 0.5] + list(r.uniform(-0.3, 0.1, d - 3)))
        systems = _systems(specs, kind="symmetric", heads=2, beta=1.0, d=d, seed=ctx.seed * 3000 + int(1000 * g),
                           steps=T)
        spectra, traj = _sweep_states(systems, n, ctx.seed + int(1000 * g))
        out = []
        for i, sp in enumerate(spectra):
            F = np.asarray(layer_matrices(systems[i]), float)[0]
            w, V = np.linalg.eigh((F + F.T) / 2)
            idx = np.argsort(-np.abs(1 + w))
            v1, v12 = V[:, idx[:1]], V[:, idx[:2]]
            mu = np.abs(1 + w[idx])
            states = np.asarray(traj.states[i], float)
            t1, t12 = _mean_direction_tan(states, v1), _mean_direction_tan(states, v12)
            out.append({"gap": g, "pred_slow": mu[1] / mu[0], "pred_fast": mu[2] / mu[0],
                        "meas_slow": fit_rate(t1, 1e-11, 5e-2), "meas_fast": fit_rate(t12, 1e-11, 1e-6),
                        "tan_v1": t1.tolist() if i == 0 else None, "tan_plane": t12.tolist() if i == 0 else None})
        return out

    rows = []
    with jax.enable_x64(True):
        for g in ctx.progress(gaps, "3 close eigenvalues"):
            rows += ctx.store.cached(f"s3_gap{g}", lambda g=g: chunk(g))
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
    d, n, T = 8, 8, 60
    heads_list = [1, 2, 4, 8]
    betas = [0.5, 1.0, 2.0, 4.0]
    per_cell = 16 if ctx.quick else 128

    def cell(H, beta):
        r = np.random.default_rng(ctx.seed * 4000 + 17 * H + int(10 * beta))
        systems, v1s = [], []
        for i in range(per_cell):
            lam1 = r.uniform(1.0, 3.0)
            spec = [lam1] + list(r.uniform(-0.5, 0.5, d - 1))
            F = spectrum_matrix(spec, kind="symmetric", d=d, rng=r)
            systems.append(synthetic_system(None, F=F, heads=H, beta=beta, seed=int(r.integers(1 << 30)), steps=T))
            w, V = np.linalg.eigh(F)
            v1s.append(V[:, np.argmax(np.abs(1 + w))])
        spectra, subs = sweep_subspaces(systems, seed=ctx.seed)
        stacked = stack_systems(systems)
        X0 = np.stack([bipartite_tokens(r, n, v, noise=0.02) for v in v1s])
        exact = np.stack([bipartite_tokens(r, n, v, noise=0.0) for v in v1s])
        V1 = np.array(v1s)
        traj = simulate_sweep(stacked, X0, subs, save_states=True)
        one = simulate_sweep(stacked, exact, subs, save_states=True)
        final = np.asarray(traj.final, float)
        cos = np.einsum("snd,sd->sn", final / np.linalg.norm(final, axis=-1, keepdims=True), V1)
        stays = np.all(np.abs(cos) > 0.95, axis=1) & np.any(cos > 0, axis=1) & np.any(cos < 0, axis=1)
        # one step from the exact +-v1 configuration: distance of each token from the line of v1
        x1 = np.asarray(one.states, float)[:, 1]
        x1 = x1 / np.linalg.norm(x1, axis=-1, keepdims=True)
        off_line = np.max(np.sqrt(np.maximum(1 - np.einsum("snd,sd->sn", x1, V1) ** 2, 0)), axis=-1)
        return {"heads": H, "beta": beta, "systems": per_cell, "fraction_bipartite": float(stays.mean()),
                "median_off_line": float(np.median(off_line))}

    cells = []
    grid = [(H, b) for H in heads_list for b in betas]
    for H, b in ctx.progress(grid, "4 bipartite"):
        cells.append(ctx.store.cached(f"s4_H{H}_b{b}", lambda H=H, b=b: cell(H, b)))
    frac = {H: np.array([c["fraction_bipartite"] for c in cells if c["heads"] == H]) for H in heads_list}
    res = {H: np.array([c["median_off_line"] for c in cells if c["heads"] == H]) for H in heads_list}
    total = sum(c["systems"] for c in cells)
    figs = [plots.plot_curve(np.array(betas), {f"{H} head{'s' if H > 1 else ''}": frac[H] for H in heads_list},
                             ctx.fig("s4_bipartite.png"), xlabel="inverse temperature β",
                             ylabel="fraction still bipartite after 60 steps",
                             title=f"Near-bipartite starts (±v1 + noise), {total} systems")]
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
