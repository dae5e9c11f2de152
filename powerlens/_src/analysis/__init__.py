"""Spectra of F_t, reference subspaces, host-side statistics (chance levels, p-values,
controls), measured runs and their results, plots.

Names are resolved on first use (PEP 562), so that importing a light module of this package
(``budget``, ``report_html``) imports no JAX."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

_MODULES = {
    **{n: "spectra" for n in ("ORDERS", "LayerSpectrum", "layer_spectra", "spectra_of", "reference_subspaces",
                              "spectra_json", "sweep_subspaces")},
    **{n: "measures" for n in ("binomial_pvalue", "chance_gamma", "chance_gamma_std", "random_subspace")},
    **{n: "experiment" for n in ("RunResult", "StepMeasures", "run_system")},
    **{n: "alignment" for n in ("AlignResult", "align_model", "model_spectra")},
}

_EXPORTS = {name: (f"{__name__}.{module}", name) for name, module in _MODULES.items()}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from .alignment import AlignResult, align_model, model_spectra
    from .experiment import RunResult, StepMeasures, run_system
    from .measures import binomial_pvalue, chance_gamma, chance_gamma_std, random_subspace
    from .spectra import (ORDERS, LayerSpectrum, layer_spectra, reference_subspaces, spectra_json, spectra_of,
                          sweep_subspaces)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
