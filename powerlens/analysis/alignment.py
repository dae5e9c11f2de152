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

from ..dynamics.layer import RULES, faithful_rule
from .experiment import StepMeasures, plot_measures, run_system
from .spectra import ORDERS, LayerSpectrum, spectra_of


def model_spectra(model) -> List[LayerSpectrum]:
    """Spectra of every unique layer's F_t (float64 on the host)."""
    return spectra_of(model.layers)


def resolve_rule(model, rule: str) -> str:
    """``faithful`` -> the model's own attention-only rule; any rule of :data:`RULES` as is."""
    if rule == "faithful":
        return faithful_rule(model.layers.config)
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; expected one of {RULES + ('faithful',)}")
    return rule


@dataclasses.dataclass
class AlignResult:
    """gamma_t / rho_t of a model on prompts, in both orderings.

    Attributes:
      rule: the rule run.
      mode: ``"layers"`` or ``"shared layer L x T"``.
      measures: order -> :class:`~powerlens.analysis.experiment.StepMeasures` ("[T+1]" arrays).
      spectra: the spectra of the layers run.
      n_tokens, n_prompts: sizes of the prompt batch.
    """

    rule: str
    mode: str
    measures: Dict[str, StepMeasures]
    spectra: List[LayerSpectrum]
    n_tokens: int
    n_prompts: int

    def summary(self, order: str) -> dict:
        """Aggregates over the steps t >= 1 where gamma is defined: the numbers behind a verdict."""
        m = self.measures[order]
        ok = np.isfinite(m.gamma[1:])
        step = lambda a: np.asarray(a, float)[1:][ok]
        g, ch, band = step(m.gamma), step(m.chance_gamma), step(m.chance_band)
        rho, rho_other = step(m.rho), step(m.rho_other_layer)
        return {
            "steps": int(ok.sum()),
            "mean_gamma": float(np.mean(g)), "mean_chance": float(np.mean(ch)),
            "share_gamma_above_chance": float(np.mean(g > ch + band)),
            "max_gamma": float(np.max(g)),
            "mean_rho": float(np.nanmean(rho)), "share_rho_above_half": float(np.nanmean(rho > 0.5)),
            "share_rho_significant": float(np.nanmean(step(m.rho_pvalue) < 0.01)),
            "mean_rho_random_control": float(np.nanmean(step(m.rho_random))),
            "mean_rho_other_layer_control": float(np.nanmean(rho_other)) if np.isfinite(rho_other).any() else None,
        }

    def to_json(self) -> dict:
        return {"rule": self.rule, "mode": self.mode, "n_tokens": self.n_tokens, "n_prompts": self.n_prompts,
                "orders": {o: {"steps": self.measures[o].rows(), "summary": self.summary(o)} for o in ORDERS}}

    def plot(self, folder: str, *, title: Optional[str] = None, prefix: str = "") -> List[str]:
        path = os.path.join(folder, f"{prefix}alignment.png")
        plot_measures(self.measures, path, over="layers" if self.mode == "layers" else "steps",
                      title=f"{title or ''} — rule {self.rule}, {self.mode}".strip(" —"))
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
    measures = {}
    n_tok = int(np.asarray(valid).sum())
    for order in ORDERS:
        res = run_system(layers, np.asarray(x0), valid, rule=r, attention="softmax", order=order, seed=seed,
                         progress=progress, spectra=spectra, desc=f"align {order}", keep_states_limit=0)
        measures[order] = res.measures
    return AlignResult(rule=r, mode=mode, measures=measures, spectra=spectra, n_tokens=n_tok,
                       n_prompts=int(np.asarray(x0).shape[0]))
