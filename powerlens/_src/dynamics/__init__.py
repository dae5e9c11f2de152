"""The token dynamics: layer parameters, attention modes, norms, layer rules, ``run`` (the one
``lax.scan`` over a schedule) and its observers, synthetic systems, sweeps.

Shapes are written as strings in the signatures and docstrings: "float[n d]" is a float
array of shape (n, d) (float32 by default, float64 on request), "bool[B n]" a mask, and so
on; U is the number of unique layers, T the number of steps, m the number of reference
subspaces. This package imports nothing from the rest of powerlens.
"""
from .schedule import Schedule
from .params import Layer, LayerConfig, Layers, constant_term, layer_factors, layer_matrices, make_layers, value_matrix
from .layer import RULES, attention_output, faithful_rule, layer_step
from .attention import ATTENTION_MODES, attention_weights
from .projections import Projections, prepared_projections, qkv_weight
from .subspaces import REFERENCES, Subspaces, null_subspaces, stack_subspaces
from .observers import Alignment, Observer, Step, alignment, consensus, final, finite, states
from .measures import Consensus
from .options import Dynamics
from .run import run, run_batch
from .simulate import Trajectory, pooled, simulate, simulate_batch

__all__ = [
    "Schedule", "Layer", "LayerConfig", "Layers", "constant_term", "layer_factors", "layer_matrices", "make_layers", "value_matrix",
    "RULES", "attention_output", "faithful_rule", "layer_step",
    "ATTENTION_MODES", "attention_weights", "Projections", "prepared_projections", "qkv_weight",
    "REFERENCES", "Subspaces", "null_subspaces", "stack_subspaces",
    "Alignment", "Consensus", "Observer", "Step", "alignment", "consensus", "final", "finite", "states",
    "Dynamics", "run", "run_batch", "Trajectory", "pooled", "simulate", "simulate_batch",
]
