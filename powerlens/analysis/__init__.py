"""Spectra of F_t, reference subspaces, host-side statistics (chance levels, p-values,
controls), measured runs and their results, plots."""
from .spectra import ORDERS, LayerSpectrum, layer_spectra, reference_subspaces, spectra_json, spectra_of, sweep_subspaces
from .measures import binomial_pvalue, chance_gamma, chance_gamma_std, random_subspace
from .experiment import RunResult, StepMeasures, run_system
from .alignment import AlignResult, align_model, model_spectra

__all__ = [
    "ORDERS", "LayerSpectrum", "layer_spectra", "spectra_of", "reference_subspaces", "spectra_json", "sweep_subspaces",
    "binomial_pvalue", "chance_gamma", "chance_gamma_std", "random_subspace",
    "RunResult", "StepMeasures", "run_system", "AlignResult", "align_model", "model_spectra",
]
