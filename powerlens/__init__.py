"""powerlens: transformer attention layers as power-method steps, in JAX.

The whole tour in one namespace::

    import powerlens as pl

    # a synthetic shared-weight system with a prescribed spectrum of F = O V (facts=True: also
    # the builder's facts, F and its spectrum by construction)
    layers = pl.synthetic_system([2.0, 0.5 + 1.0j, 0.3], kind="normal", heads=2, d=8, steps=60)
    spectra = pl.spectra_of(layers)                               # both orderings, per layer
    subs = pl.reference_subspaces(spectra)                        # principal + random + other layer
    x0 = pl.sphere_tokens(np.random.default_rng(0), 16, 8)        # (n, d)
    out = pl.run(layers, x0, None, dynamics=pl.Dynamics(rule="paper", attention="softmax"),   # the default
                 observers={"align": pl.alignment(subs), "consensus": pl.consensus()})
    traj = pl.simulate_batch(layers, x0[None], subs)              # every measure, vmapped over prompts

    # a pretrained model
    model = pl.load("minilm")                                     # or smollm2, a folder, a .gguf
    x0, valid = pl.embed(model, ["The cat sat on the mat."])
    res = pl.align(model, ["The cat sat on the mat."], dynamics=pl.Dynamics.faithful())

    # a decoder's own forward pass, cached: states, attention, gamma/rho by reference, logits
    smol = pl.load("smollm2")
    tr = pl.trace(smol, ["The capital of France is"], attention_weights=True)   # Dynamics.full(): the model's pass
    tr.gamma["principal"], tr.rho["random"], tr.attention.shape      # "float[T]", "float[T]", (T, B, H, n, n)
    pl.top_tokens(smol, tr.next_logits[0], k=3)                   # [TopToken(id, text=' Paris', prob), ...]
    hs = pl.hidden_states(smol, *pl.embed(smol, ["The capital of France is"]))
    pl.logits(smol, hs[-1])                                        # the model's logits (final norm applied once)
    pl.decode(smol, pl.tokenize(smol, ["The capital of France is"])[0])
    u = pl.parse_direction("token:king", model=model).vector
    a = pl.minimal_alpha(model.layers, u, x0, valid=valid, target=0.9, w="value").alignment.alpha
    steered = pl.rank1(model.layers, u, alpha=a, w="value")
    learned = pl.optimize_steering(model.layers, x0, pl.AlignmentObjective(u, target=0.9), valid=valid)

Names are resolved on first use (PEP 562), so ``import powerlens`` stays cheap and the
command line starts fast; ``dir(pl)`` and ``pl.__all__`` list them all.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ._src.lazy import lazy_exports

__version__ = "0.1.0"

# public name -> (module, attribute); attribute None: the module itself
_EXPORTS = {
    # dynamics: parameters, the one scan and its observers, synthetic systems
    **{n: ("powerlens._src.dynamics", n) for n in (
        "Layer", "LayerConfig", "Layers", "layer_matrices", "layer_factors", "make_layers", "constant_term", "value_matrix",
        "RULES", "ATTENTION_MODES", "layer_step", "attention_output", "faithful_rule",
        "Subspaces", "null_subspaces", "REFERENCES",
        "Dynamics", "run", "run_batch", "Observer", "Step", "alignment", "consensus", "states", "final", "finite",
        "Schedule",
        "Alignment", "Consensus", "Trajectory", "simulate", "simulate_batch", "pooled")},
    **{n: ("powerlens._src.dynamics.parts", n) for n in ("Attention", "Norms", "FFN")},     # the parts of Layers
    **{n: ("powerlens._src.dynamics.synthetic", n) for n in (
        "synthetic_system", "spectrum_matrix", "parse_spectrum", "sphere_tokens", "cone_tokens",
        "bipartite_tokens")},
    **{n: ("powerlens._src.dynamics.observers", n) for n in ("attention_maps", "head_weights", "labelled")},
    "simulate_sweep": ("powerlens._src.dynamics.sweep", "simulate_sweep"),
    "stack_systems": ("powerlens._src.dynamics.sweep", "stack_systems"),
    "sweep": ("powerlens._src.sweeps.api", "sweep"),
    "load_sweep": ("powerlens._src.sweeps.api", "load_sweep"),
    "sweep_system": ("powerlens._src.sweeps.api", "sweep_system"),
    "SweepSystem": ("powerlens._src.sweeps.api", "SweepSystem"),
    "systems_from_layers": ("powerlens._src.sweeps.systems", "from_layers"),   # a custom sweep builder's result
    "fit_rates": ("powerlens._src.sweeps.columns", "fit_rates"),
    # models: checkpoints, embeddings, the model's own forward pass
    **{n: ("powerlens._src.models", n) for n in (
        "load", "resolve", "embed", "embed_ids", "tokenize", "hidden_states", "logits", "run_states",
        "Model", "ModelInfo", "CheckpointError")},
    "HiddenStates": ("powerlens._src.models.forward", "HiddenStates"),
    **{n: ("powerlens._src.models.npz", n) for n in ("load_weights_npz", "save_weights_npz")},   # --weights files
    **{n: ("powerlens._src.models.generate", n) for n in ("generate", "Generation")},
    **{n: ("powerlens._src.models.shard", n) for n in ("shard", "shard_prompts")},
    **{n: ("powerlens._src.dynamics.execution", n) for n in ("model_mesh", "host_array")},
    **{n: ("powerlens._src.models.tokens", n) for n in ("decode", "top_tokens", "TopToken")},
    # analysis: spectra, statistics, alignment of a model
    **{n: ("powerlens._src.analysis", n) for n in (
        "ORDERS", "LayerSpectrum", "layer_spectra", "spectra_of", "reference_subspaces", "spectra_json", "sweep_subspaces",
        "binomial_pvalue", "chance_gamma", "chance_gamma_std", "random_subspace",
        "AlignResult", "align_model", "model_spectra", "run_system")},
    "align": ("powerlens._src.analysis", "align_model"),
    "trace": ("powerlens._src.analysis.trace", "trace"),
    "Trace": ("powerlens._src.analysis.trace", "Trace"),
    "plots": ("powerlens._src.analysis.plots", None),             # the figure functions, a module
    # steering
    **{n: ("powerlens._src.steering", n) for n in (
        "rank1", "Rank1Result", "minimal_alpha", "MinimalAlpha", "principal_alpha", "alignment_alpha",
        "optimize_steering", "SteeringResult", "AlignmentObjective", "TokenObjective", "SteeringConfig", "output_effects", "steered_model", "forward_final",
        "parse_direction", "Direction", "checkpoint_delta", "entering_states",
        "TokenSteeringResult", "CONTROL_PROMPTS", "edit_effects")},
    **{n: ("powerlens._src.steering.edit_file", n) for n in ("Edit", "make_edit", "save_edit", "load_edit", "apply_edit")},
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:        # what IDEs and type checkers see: the names of _EXPORTS, imported eagerly
    # (tests/test_api_surface.py keeps the two equal)
    from ._src.dynamics import (alignment, Alignment, ATTENTION_MODES, attention_output, consensus, Consensus,
        constant_term, Dynamics, faithful_rule, final, finite, Layer, layer_factors, layer_matrices,
        layer_step, LayerConfig, Layers, make_layers, null_subspaces, Observer, pooled, REFERENCES, RULES, run,
        run_batch, Schedule, simulate, simulate_batch, states, Step, Subspaces, Trajectory, value_matrix)
    from ._src.dynamics.parts import (Attention, FFN, Norms)
    from ._src.dynamics.synthetic import (bipartite_tokens, cone_tokens, parse_spectrum, spectrum_matrix,
        sphere_tokens, synthetic_system)
    from ._src.dynamics.observers import (attention_maps, head_weights, labelled)
    from ._src.dynamics.sweep import (simulate_sweep, stack_systems)
    from ._src.sweeps.api import (load_sweep, sweep, sweep_system, SweepSystem)
    from ._src.sweeps.systems import (from_layers as systems_from_layers)
    from ._src.sweeps.columns import (fit_rates)
    from ._src.models import (CheckpointError, embed, embed_ids, hidden_states, load, logits, Model, ModelInfo,
        resolve, run_states, tokenize)
    from ._src.models.forward import (HiddenStates)
    from ._src.models.npz import (load_weights_npz, save_weights_npz)
    from ._src.models.generate import (generate, Generation)
    from ._src.models.shard import (shard, shard_prompts)
    from ._src.dynamics.execution import (host_array, model_mesh)
    from ._src.models.tokens import (decode, top_tokens, TopToken)
    from ._src.analysis import (align_model as align, align_model, AlignResult, binomial_pvalue, chance_gamma,
        chance_gamma_std, layer_spectra, LayerSpectrum, model_spectra, ORDERS, plots, random_subspace,
        reference_subspaces, run_system, spectra_json, spectra_of, sweep_subspaces)
    from ._src.analysis.trace import (trace, Trace)
    from ._src.steering import (alignment_alpha, AlignmentObjective, checkpoint_delta, CONTROL_PROMPTS, Direction,
        edit_effects, entering_states, forward_final, minimal_alpha, MinimalAlpha, optimize_steering,
        output_effects, parse_direction, principal_alpha, rank1, Rank1Result, steered_model, SteeringConfig,
        SteeringResult, TokenObjective, TokenSteeringResult)
    from ._src.steering.edit_file import (apply_edit, Edit, load_edit, make_edit, save_edit)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
