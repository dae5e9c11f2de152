"""``trace``: one run of a model on prompts, with everything it shows under named fields.

The Python twin of ``powerlens align`` and a researcher's activation cache in one result::

    tr = trace(model, ["The capital of France is"], attention_weights=True)   # Dynamics.full()
    tr.inputs[t], tr.outputs[t]     # "float[B n d]" what layer t reads and writes (steps 0-based)
    tr.attention[t]                 # "float[B H n n]" its softmax weights, per head
    tr.gamma["principal"][t]        # gamma_t against that layer's principal subspace; also
    tr.rho["random"][t]             #   "random" and "other_layer", the controls
    tr.logits                       # "float[B n V]" (decoders), tr.next_logits "float[B V]"

It is one :func:`powerlens._src.dynamics.run` (one ``lax.scan``, vmapped over the prompts) with
the one bundle of a measured run, :func:`~powerlens._src.dynamics.observers.run_observers`
(``alignment`` against :func:`~powerlens._src.analysis.spectra.reference_subspaces` of the chosen
ordering, ``consensus``, ``finite``, ``final``, and ``states``) and, on request,
``attention_maps`` as its extra; the logits are the LM head on its last state. Its gamma_t
and rho_t are those of :func:`~powerlens._src.analysis.alignment.align_model` (the same pooling
over prompts, weighted by valid tokens: :func:`~powerlens._src.dynamics.simulate.pooled`), and
:attr:`Trace.measures` is the :class:`~powerlens._src.analysis.experiment.StepMeasures` that
``powerlens align`` writes to align.json for that ordering.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..dynamics.inputs import check_batch
from ..dynamics.observers import attention_maps, rotation_planes, run_observers
from ..dynamics.options import Dynamics, as_dynamics
from ..dynamics.projections import prepared_projections
from ..dynamics.run import map_prompts, platform_of, prompt_chunk, run
from ..dynamics.simulate import pooled, trajectory
from .alignment import model_spectra, resolve_rule
from .experiment import NonFiniteStateError, StepMeasures, first_non_finite, prompt_values, step_measures
from .spectra import LayerSpectrum, check_order, reference_subspaces

CONTROLS = ("principal", "random", "other_layer")
"""The references every measure is labelled with: the layer's principal subspace, a random
subspace of the same dimension, another layer's principal subspace."""


@dataclasses.dataclass(frozen=True)
class Trace:
    """One run of a model on prompts (T steps of its schedule, B prompts right-padded to n
    tokens, width d, H heads, vocabulary V). Steps and layers are numbered from 0: step t
    applies unique layer ``layer[t]`` (= t for a model whose layers are all distinct).

    Attributes:
      rule: the rule run (``full``: the model's own blocks; ``paper``, ``post_ln``, ``pre_ln``).
      order: the ordering of the references (``shifted`` or ``plain``).
      ids: "int[B n]" the token ids; valid: "bool[B n]" False on padding.
      layer: "int[T]" the unique layer applied at each step.
      states: "float[T+1 B n d]" x_0 (the embeddings) .. x_T, the residual stream (no final
        norm); ``inputs``/``outputs`` are its views per step.
      attention: "float[T B H n n]" each step's attention weights per head (rows sum to 1;
        padding queries uniform), or None unless asked for (``attention_weights=True``).
      logits: "float[B n V]" the LM head on the final norm of x_T (decoders; None for an
        encoder): the model's logits under rule ``full``.
      measures: the pooled measures per state t = 0..T (index 0: x_0), exactly the ``steps``
        of ``powerlens align``'s align.json for this ordering, with each prompt's gamma_t and
        rho_t (``measures.prompt_gamma``, ``prompt_rho`` "float[B T+1]").
      spectra: the spectra of the unique layers (computed once per set of weights and kept:
        :func:`~powerlens._src.analysis.spectra.spectra_of`).
    """

    rule: str
    order: str
    ids: np.ndarray
    valid: np.ndarray
    layer: np.ndarray
    states: jax.Array
    attention: Optional[jax.Array]
    logits: Optional[jax.Array]
    measures: StepMeasures
    spectra: List[LayerSpectrum]

    @property
    def inputs(self) -> jax.Array:
        """"float[T B n d]": the tokens entering step t (``states[t]``)."""
        return self.states[:-1]

    @property
    def outputs(self) -> jax.Array:
        """"float[T B n d]": the tokens leaving step t (``states[t + 1]``)."""
        return self.states[1:]

    @property
    def gamma(self) -> Dict[str, np.ndarray]:
        """gamma_t "float[T]" of the tokens leaving step t, against each reference of that
        step's layer: ``{"principal": ..., "random": ..., "other_layer": ...}`` (NaN where a
        reference is undefined: no other layer in a one-layer model)."""
        m = self.measures
        return dict(zip(CONTROLS, (m.gamma[1:], m.gamma_random[1:], m.gamma_other_layer[1:])))

    @property
    def rho(self) -> Dict[str, np.ndarray]:
        """rho_t "float[T]", the share of tokens whose gamma grows across step t, against each
        reference (the keys of :attr:`gamma`)."""
        m = self.measures
        return dict(zip(CONTROLS, (m.rho[1:], m.rho_random[1:], m.rho_other_layer[1:])))

    @property
    def last(self) -> np.ndarray:
        """"int[B]" the position of each prompt's last valid token."""
        return self.valid.shape[1] - 1 - np.argmax(self.valid[:, ::-1], axis=1)

    @property
    def next_logits(self) -> Optional[jax.Array]:
        """"float[B V]" the logits at each prompt's last valid token (the next-token
        prediction; None for an encoder)."""
        if self.logits is None:
            return None
        return self.logits[jnp.arange(self.logits.shape[0]), jnp.asarray(self.last)]

    def __repr__(self) -> str:
        shape = lambda a: "None" if a is None else "x".join(map(str, a.shape))
        return (f"Trace(rule={self.rule!r}, order={self.order!r}, steps={len(self.layer)}, prompts={self.ids.shape[0]}, "
                f"tokens={int(self.valid.sum())}, states={shape(self.states)}, attention={shape(self.attention)}, "
                f"logits={shape(self.logits)})")


@functools.partial(jax.jit, static_argnames=("dynamics", "maps", "chunk"))
def _trace_batch(layers, X0, valid, subspaces, projections, planes, *, dynamics, maps, chunk):
    """The observers of one run per prompt, states and attention maps steps-first."""
    observers = run_observers(subspaces, planes=planes, save_states=True,
                              extras={"attention": attention_maps(layers, rule=dynamics.rule)} if maps else None)

    def one(x, v):
        return run(layers, x, v, dynamics=dynamics, observers=observers,
                   projections=projections)

    out_axes = {name: int(name in ("states", "attention")) for name in observers}
    return map_prompts(one, X0, valid, chunk, out_axes=out_axes)


def trace(model, prompts: Sequence, *, dynamics: Optional[Dynamics] = None, order: str = "shifted",
          attention_weights: bool = False, seed: int = 0, spectra: Optional[List[LayerSpectrum]] = None,
          rule: Optional[str] = None, keep_bias: Optional[bool] = None) -> Trace:
    """Run ``model`` on ``prompts`` once and keep every state, the measures and the logits.

    Args:
      model: a loaded :class:`~powerlens._src.models.base.Model`.
      prompts: texts (tokenized by the model's tokenizer) or token-id lists.
      dynamics: a :class:`~powerlens._src.dynamics.options.Dynamics` with softmax attention; default
        ``Dynamics.full()`` (the model's own blocks, FFN included, so ``logits`` are the
        model's); its rule may be ``paper``, ``post_ln``, ``pre_ln`` or ``faithful`` (the
        model's attention-only rule), its ``keep_bias`` None keeps c = O b_v + b_o except
        under ``paper``.
      order: the ordering of the reference subspaces, ``shifted`` (by |1 + lambda|) or ``plain``.
      attention_weights: also keep every step's attention weights per head, "float[T B H n n]"
        (O(T B H n^2) memory).
      rule, keep_bias: deprecated, ``dynamics``' fields as loose keywords.
      seed: the seed of the random-subspace control (as ``powerlens align --seed``).
      spectra: the spectra of the model's layers, when computed already (``model_spectra``);
        by default those of :func:`~powerlens._src.analysis.spectra.spectra_of`, computed on the
        first call for these weights and taken from its cache on the next ones (an edited
        model, e.g. ``steered_model``, has new weights and gets its own).

    Returns a :class:`Trace`. Raises a :class:`~powerlens._src.analysis.experiment.NonFiniteStateError`
    naming the first step whose state or measure is not finite.
    """
    from ..models.embed import embed_ids, padded_ids, prompt_ids
    from ..models.forward import logits as model_logits
    dyn = as_dynamics(dynamics, rule, None, keep_bias, default=Dynamics.full(), where="trace")
    if dyn.attention != "softmax":
        raise ValueError(f"trace runs the model's softmax attention; got Dynamics.attention={dyn.attention!r}")
    r, keep_bias = resolve_rule(model, dyn.rule), dyn.keep_bias
    check_order(order)
    if not isinstance(attention_weights, bool):
        raise ValueError(f"attention_weights must be True or False, got {attention_weights!r}")
    ids, valid = padded_ids(model, prompt_ids(model, prompts))
    x0, _ = embed_ids(model, ids, valid)
    layers = model.layers
    X0, valid = check_batch(np.asarray(x0), valid, layers.config.d_model)
    spectra = model_spectra(model) if spectra is None else spectra
    if len(spectra) != layers.n_unique:
        raise ValueError(f"spectra has {len(spectra)} layers, the model {layers.n_unique} unique layers")
    subs = reference_subspaces(spectra, order=order, seed=seed, dtype=layers.dtype)
    # weights held in another dtype than the compute dtype are cast a layer at a time: no (in, out) copies
    proj = prepared_projections(layers, "softmax") if layers.dtype == layers.storage_dtype else None
    out = _trace_batch(layers, X0, valid, subs, proj,
                       rotation_planes(subs, layers), dynamics=Dynamics(r, "softmax", keep_bias, dyn.attention_block),
                       maps=attention_weights,
                       chunk=prompt_chunk(*X0.shape[:2], platform_of(layers.W_v)))
    all_states = out.pop("states")          # steps-first "float[T+1 B n d]": the Trace's own
    traj = trajectory(out, valid, subs.names)
    metrics = pooled(traj)
    schedule = np.asarray(layers.schedule.array(0, len(layers.schedule)), np.int64)
    bad = first_non_finite(metrics, np.asarray(subs.dim)[schedule] > 0)
    if bad is not None:
        raise NonFiniteStateError(bad[0], len(schedule), r, layers.W_v.dtype, state=bad[1])
    decoder = bool(model.info is not None and model.info.decoder)
    return Trace(rule=r, order=order, ids=ids, valid=valid, layer=schedule, states=all_states,
                 attention=out.get("attention"), logits=model_logits(model, out["final"]) if decoder else None,
                 measures=step_measures(metrics, schedule, subs, layers.config.d_model, [prompt_values(traj, subs)]),
                 spectra=spectra)
