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
from ..dynamics.options import Dynamics, as_dynamics
from .experiment import StepMeasures, plot_measures, run_system
from .spectra import ORDERS, LayerSpectrum, host_layer_matrices, kept_spectra, layer_spectra, spectra_of


def model_spectra(model, *, progress: bool = False) -> List[LayerSpectrum]:
    """Spectra of every unique layer's F_t (float64 on the host), computed once per set of
    weights and kept while they live (:func:`~powerlens._src.analysis.spectra.spectra_of`); for a
    model whose F_t of every layer would not fit in :data:`WHOLE_STACK_BYTES`, one layer at a
    time (:func:`spectra_by_layer`, ``progress``: a bar on stderr)."""
    if whole_stack_fits(model.layers):
        return spectra_of(model.layers)
    return kept_spectra(model.layers, lambda: spectra_by_layer(model.layers, progress=progress))


WHOLE_STACK_BYTES = 512 << 20
"""Above this many bytes of F for every layer (float32 and its float64 copy), the spectra are
computed one layer at a time (:func:`spectra_by_layer`)."""


def whole_stack_fits(layers) -> bool:
    return layers.n_unique * layers.config.d_model ** 2 * 12 <= WHOLE_STACK_BYTES


def spectra_by_layer(layers, *, progress: bool = False):
    """The spectra of every unique layer, one layer at a time: that layer's factors A "float[d r]"
    (W_o with the columns of query heads sharing a key/value head summed) and B "float[r d]" (its
    W_v) in the compute dtype (:func:`~powerlens._src.dynamics.params.layer_factors`), F_t = A B formed
    from them (r/d of the cost of W_o V_cat: a quarter for Llama-3-8B), then the float64
    eigen-decomposition from the r x r matrix B A (:func:`~powerlens._src.analysis.spectra.layer_spectra`).
    Peak memory is one layer's F and eig workspace beside the stored weights, not U of them."""
    import sys

    import jax
    import jax.numpy as jnp

    from ..dynamics.params import layer_factors
    out = []
    U = layers.n_unique
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=U, desc="spectra", unit="layer", file=sys.stderr)
    for u in range(U):
        one = jax.tree_util.tree_map(lambda a: a[u:u + 1], layers)
        A, B = layer_factors(one)
        F = np.asarray(jnp.einsum("udr,urc->udc", A, B))
        (spectrum,) = layer_spectra(F, factors=(np.asarray(A), np.asarray(B)))
        spectrum.layer = u
        out.append(spectrum)
        del F, A, B, one
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return out


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
      measures: order -> :class:`~powerlens._src.analysis.experiment.StepMeasures` ("[T+1]" arrays).
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
        """align.json's numbers: per ordering, ``steps`` (one row per state t, the pooled
        measures), ``summary`` and ``per_prompt`` (each prompt's gamma_t and rho_t and their
        standard errors across prompts: :meth:`StepMeasures.per_prompt`)."""
        orders = {}
        for o in ORDERS:
            m = self.measures[o]
            orders[o] = {"steps": m.rows(), "summary": self.summary(o)}
            if m.prompt_tokens is not None:
                orders[o]["per_prompt"] = m.per_prompt()
        return {"rule": self.rule, "mode": self.mode, "n_tokens": self.n_tokens, "n_prompts": self.n_prompts,
                "orders": orders}

    def plot(self, folder: str, *, title: Optional[str] = None, prefix: str = "") -> List[str]:
        path = os.path.join(folder, f"{prefix}alignment.png")
        plot_measures(self.measures, path, over="layers" if self.mode == "layers" else "steps",
                      title=f"{title or ''} — rule {self.rule}, {self.mode}".strip(" —"))
        return [path]


def align_model(model, texts_or_ids: Sequence, *, dynamics: Optional[Dynamics] = None,
                shared_layer: Optional[int] = None, steps: Optional[int] = None, seed: int = 0,
                progress: bool = False, x0=None, valid=None, spectra: Optional[List[LayerSpectrum]] = None,
                rule: Optional[str] = None) -> AlignResult:
    """Measure gamma_t/rho_t of ``model`` on prompts, in both orderings.

    ``dynamics``: a :class:`~powerlens._src.dynamics.options.Dynamics`, default ``Dynamics()`` (the
    paper's rule); ``Dynamics.faithful()`` runs the model's own norm placement. ``rule``:
    deprecated, its rule as a loose keyword.
    ``shared_layer``/``steps``: iterate that unique layer T times as a shared-weight system.
    """
    from ..models.embed import embed
    dyn = as_dynamics(dynamics, rule, where="align")
    r = resolve_rule(model, dyn.rule)
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
        res = run_system(layers, np.asarray(x0), valid, dynamics=dataclasses.replace(dyn, rule=r), order=order,
                         seed=seed, progress=progress, spectra=spectra, desc=f"align {order}", keep_states_limit=0,
                         per_prompt=True)
        measures[order] = res.measures
    return AlignResult(rule=r, mode=mode, measures=measures, spectra=spectra, n_tokens=n_tok,
                       n_prompts=int(np.asarray(x0).shape[0]))
