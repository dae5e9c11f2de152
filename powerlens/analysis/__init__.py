"""Spectra of F_t, alignment and consensus measures, statistics, plots, reports."""
from .spectra import ORDERS, LayerSpectrum, Subspaces, layer_spectra, reference_subspaces, spectra_json
from .measures import binomial_pvalue, chance_gamma, chance_gamma_std
