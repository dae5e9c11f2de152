"""One measured run of a system: spectra -> reference subspaces -> chunked simulation
(with a progress bar) -> pooled per-step metrics, ready for JSON/CSV and plots.

The simulation is run in chunks of the schedule so that long runs show progress and
memory stays bounded; each chunk is the same jitted ``simulate_batch`` call.
"""
from __future__ import annotations

import csv
import dataclasses
import io
from typing import List, Optional

import numpy as np

from ..dynamics.params import Layers, layer_matrices
from ..dynamics.simulate import check_tokens, pooled, simulate_batch
from .measures import binomial_pvalue, chance_gamma, chance_gamma_std
from .spectra import LayerSpectrum, Subspaces, check_order, layer_spectra, reference_subspaces

REF_NAMES = ("principal", "random", "other_layer")


@dataclasses.dataclass
class RunResult:
    spectra: List[LayerSpectrum]
    subspaces: Subspaces
    schedule: tuple
    order: str
    metrics: dict                      # pooled arrays (see powerlens.dynamics.simulate.pooled)
    states: Optional[np.ndarray]       # (T+1, B, n, d) when kept
    d: int

    @property
    def steps(self) -> int:
        return len(self.schedule)

    def chance(self, t: int) -> tuple:
        """(mean, std of one token) of gamma for a random token against S of step t."""
        k = int(np.asarray(self.subspaces.dim)[self.schedule[t], 0])
        return chance_gamma(self.d, k), chance_gamma_std(self.d, k)

    def rows(self) -> List[dict]:
        """One row per state t = 0..T: gamma, rho (null at t = 0), consensus, rotation, controls."""
        m = self.metrics
        n_tok = m["n_tokens"]
        out = []
        for t in range(self.steps + 1):
            row = {"t": t}
            if t == 0:
                row.update(layer=None, gamma=m["gamma_before"][0, 0], rho=None, rotation=None,
                           gamma_random=m["gamma_before"][0, 1], rho_random=None,
                           gamma_other_layer=m["gamma_before"][0, 2], rho_other_layer=None, rho_pvalue=None)
                ch, sd = self.chance(0)
            else:
                g, r = m["gamma"][t - 1], m["rho"][t - 1]
                row.update(layer=self.schedule[t - 1], gamma=g[0], rho=r[0], rotation=m["rotation"][t - 1],
                           gamma_random=g[1], rho_random=r[1], gamma_other_layer=g[2], rho_other_layer=r[2],
                           rho_pvalue=binomial_pvalue(int(m["rho_count"][t - 1, 0]), n_tok)
                           if np.isfinite(r[0]) else None)
                ch, sd = self.chance(t - 1)
            row.update(consensus=m["consensus"][t], rank_collapse=m["rank_collapse"][t],
                       pairwise_cos=m["pairwise_cos"][t], chance_gamma=ch,
                       chance_band=2 * sd / np.sqrt(max(n_tok, 1)))
            out.append({k: _num(v) for k, v in row.items()})
        return out


def _num(v):
    if v is None:
        return None
    if isinstance(v, (int, np.integer)):
        return int(v)
    f = float(v)
    return f if np.isfinite(f) else None


def column(rows: List[dict], key: str, *, skip_initial: bool = True) -> np.ndarray:
    """One field of :meth:`RunResult.rows` as a float array (None -> NaN), by default for t >= 1."""
    return np.array([np.nan if r[key] is None else r[key] for r in (rows[1:] if skip_initial else rows)], float)


def rows_csv(rows: List[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0].keys()))
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if v is None else v) for k, v in r.items()})
    return buf.getvalue()


def run_system(layers: Layers, X0, valid=None, *, rule: str = "paper", attention: str = "softmax",
               order: str = "shifted", keep_bias: Optional[bool] = None, seed: int = 0,
               save_states: bool = False, keep_states_limit: int = 4_000_000, chunk: int = 100,
               progress: bool = True, desc: str = "simulate", spectra: Optional[List[LayerSpectrum]] = None,
               positions=None) -> RunResult:
    """Spectra, reference subspaces and the measured simulation of ``layers`` from X0.

    States are kept when ``save_states`` or when they are small (<= keep_states_limit
    numbers), for plotting trajectories.
    """
    from tqdm.auto import tqdm

    check_order(order)
    X0 = check_tokens(X0, layers.config.d_model)
    if X0.ndim == 2:
        X0 = X0[None]
    if spectra is None:
        spectra = layer_spectra(np.asarray(layer_matrices(layers)))
    subs = reference_subspaces(spectra, order=order, seed=seed, dtype=layers.W_v.dtype)
    schedule = layers.schedule
    T = len(schedule)
    keep = save_states or (T + 1) * X0.size <= keep_states_limit
    parts, states = [], [np.asarray(X0)[None]] if keep else None
    X = X0
    with tqdm(total=T, desc=desc, disable=not progress, leave=False) as bar:
        for start in range(0, T, chunk):
            sched = np.asarray(schedule[start:start + chunk], np.int32)
            traj = simulate_batch(layers, X, subs, valid=valid, rule=rule, attention=attention,
                                  keep_bias=keep_bias, save_states=keep, schedule=sched, positions=positions)
            parts.append(pooled(traj))
            if keep:
                states.append(np.swapaxes(np.asarray(traj.states), 0, 1)[1:])
            X = np.asarray(traj.final)
            if not np.all(np.isfinite(X)):
                raise FloatingPointError(
                    f"the state became non-finite at a step in [{start}, {start + len(sched)}); "
                    f"try float64 (--x64) or another rule")
            bar.update(len(sched))
    metrics = {
        k: np.concatenate([parts[0][k]] + [p[k][1:] for p in parts[1:]])
        if k in ("consensus", "rank_collapse", "pairwise_cos") else
        (parts[0][k] if k == "n_tokens" else np.concatenate([p[k] for p in parts]))
        for k in parts[0]
    }
    return RunResult(spectra=spectra, subspaces=subs, schedule=tuple(schedule), order=order, metrics=metrics,
                     states=np.concatenate(states) if keep else None, d=layers.config.d_model)
