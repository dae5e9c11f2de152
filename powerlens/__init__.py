"""powerlens: transformer attention layers as power-method steps, in JAX.

Quick tour::

    import powerlens as pl
    layers = pl.synthetic_system([3.0, 1.0, 0.5], kind="symmetric", heads=2, d=16, steps=50)
    spec = pl.layer_spectra(pl.layer_matrices(layers))      # both orderings, per layer
    subs = pl.reference_subspaces(spec)                       # principal + controls
    traj = pl.simulate_batch(layers, x0, subs, attention="uniform")
"""
from .dynamics.params import LayerConfig, Layers, layer_matrices, make_layers
from .dynamics.simulate import Trajectory, pooled, simulate, simulate_batch
from .dynamics.synthetic import (bipartite_tokens, cone_tokens, parse_spectrum, sphere_tokens,
                                 spectrum_matrix, synthetic_system)
from .analysis.spectra import Subspaces, layer_spectra, reference_subspaces

__version__ = "0.1.0"
