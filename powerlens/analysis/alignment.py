"""gamma_t and rho_t of a pretrained model on prompts, in both orderings (design.md §3).

For each layer t (or each step of a layer iterated as a shared-weight system):

    gamma_t   mean over valid tokens of ||P_S x_i|| / ||x_i|| after the layer, S = S_t
    rho_t     share of tokens whose gamma_i grows across the layer (against S_t)
    controls  the same against a random subspace of equal dimension and against S of
              another layer, the chance level of gamma, and a one-sided binomial p-value
              for rho_t > 1/2 (tokens of one prompt are not independent: read it as a
              screening number, not a test)
"""
from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..dynamics.layer import faithful_rule
from ..dynamics.params import layer_matrices
from .experiment import column, run_system
from .spectra import ORDERS, LayerSpectrum, layer_spectra


def model_spectra(model) -> List[LayerSpectrum]:
    """Spectra of every unique layer's F_t (float64 on the host)."""
    return layer_spectra(np.asarray(layer_matrices(model.layers), np.float64))


def resolve_rule(model, rule: str) -> str:
    if rule == "faithful":
        return faithful_rule(model.layers.config)
    if rule not in ("paper", "post_ln", "pre_ln", "full"):
        raise ValueError(f"unknown rule {rule!r}; expected paper or faithful")
    return rule


@dataclasses.dataclass
class AlignResult:
    rule: str
    mode: str                         # "layers" or "shared layer L x T"
    rows: Dict[str, List[dict]]       # order -> rows t = 0..T (see RunResult.rows)
    spectra: List[LayerSpectrum]
    n_tokens: int
    n_prompts: int

    def summary(self, order: str) -> dict:
        """Aggregates over steps t >= 1: the numbers behind a verdict."""
        rows = [r for r in self.rows[order][1:] if r["gamma"] is not None]
        g = np.array([r["gamma"] for r in rows])
        ch = np.array([r["chance_gamma"] for r in rows])
        band = np.array([r["chance_band"] for r in rows])
        rho = np.array([np.nan if r["rho"] is None else r["rho"] for r in rows])
        rho_rand = np.array([np.nan if r["rho_random"] is None else r["rho_random"] for r in rows])
        rho_other = np.array([np.nan if r["rho_other_layer"] is None else r["rho_other_layer"] for r in rows])
        p = np.array([np.nan if r["rho_pvalue"] is None else r["rho_pvalue"] for r in rows])
        return {
            "steps": len(rows),
            "mean_gamma": float(np.mean(g)), "mean_chance": float(np.mean(ch)),
            "share_gamma_above_chance": float(np.mean(g > ch + band)),
            "max_gamma": float(np.max(g)),
            "mean_rho": float(np.nanmean(rho)), "share_rho_above_half": float(np.nanmean(rho > 0.5)),
            "share_rho_significant": float(np.nanmean(p < 0.01)),
            "mean_rho_random_control": float(np.nanmean(rho_rand)),
            "mean_rho_other_layer_control": float(np.nanmean(rho_other)) if np.isfinite(rho_other).any() else None,
        }

    def to_json(self) -> dict:
        return {"rule": self.rule, "mode": self.mode, "n_tokens": self.n_tokens, "n_prompts": self.n_prompts,
                "orders": {o: {"steps": self.rows[o], "summary": self.summary(o)} for o in ORDERS}}

    def plot(self, folder: str, *, title: Optional[str] = None, prefix: str = "") -> List[str]:
        from . import plots
        col = lambda o, k: column(self.rows[o], k)
        t = np.array([r["t"] for r in self.rows["shifted"][1:]])
        label = "layer t" if self.mode == "layers" else "step t"
        path = os.path.join(folder, f"{prefix}alignment.png")
        plots.plot_alignment(
            t, {o: col(o, "gamma") for o in ORDERS}, {o: col(o, "rho") for o in ORDERS}, path,
            chance=col("shifted", "chance_gamma"), chance_band=col("shifted", "chance_band"),
            gamma_controls={"random subspace": col("shifted", "gamma_random")},
            rho_controls={"random subspace": col("shifted", "rho_random"),
                          "other layer": col("shifted", "rho_other_layer")},
            xlabel=label, title=f"{title or ''} — rule {self.rule}, {self.mode}".strip(" —"))
        return [path]


def align_model(model, texts_or_ids: Sequence, *, rule: str = "paper", shared_layer: Optional[int] = None,
                steps: Optional[int] = None, seed: int = 0, progress: bool = False, x0=None, valid=None,
                spectra: Optional[List[LayerSpectrum]] = None) -> AlignResult:
    """Measure gamma_t/rho_t of ``model`` on prompts, in both orderings.

    ``rule``: ``paper`` (default) or ``faithful`` (the model's own norm placement).
    ``shared_layer``/``steps``: iterate that unique layer T times as a shared-weight system.
    """
    from ..models.embed import embed
    r = resolve_rule(model, rule)
    if x0 is None:
        x0, valid = embed(model, texts_or_ids)
    layers = model.layers
    if spectra is None:
        spectra = model_spectra(model)
    mode = "layers"
    if shared_layer is not None:
        if steps is None:
            raise ValueError("--shared-layer needs --steps")
        layers = layers.shared(shared_layer, steps)
        spectra = [spectra[shared_layer]]
        mode = f"shared layer {shared_layer} x {steps}"
    rows = {}
    n_tok = int(np.asarray(valid).sum())
    for order in ORDERS:
        res = run_system(layers, np.asarray(x0), valid, rule=r, attention="softmax", order=order, seed=seed,
                         progress=progress, spectra=spectra, desc=f"align {order}", keep_states_limit=0)
        rows[order] = res.rows()
    return AlignResult(rule=r, mode=mode, rows=rows, spectra=spectra, n_tokens=n_tok,
                       n_prompts=int(np.asarray(x0).shape[0]))
