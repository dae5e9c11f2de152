"""The systems of a sweep: what one row is computed from.

A :class:`Systems` holds one shared-weight system, its initial tokens and everything its
columns are measured against (a batch adds a leading axis S to every array). It comes
from one of three builders:

* ``synthetic`` (the default): built on the device, inside the compiled program, from
  the system's seed and grid values alone by :func:`powerlens._src.dynamics.synthetic.synthetic`
  (:func:`synthetic_systems` arranges its facts for the measures): F = Q D Q^T (symmetric, normal)
  or S D S^-1 (nonnormal) with D the block-diagonal form of the spectrum (LAPACK-free:
  :mod:`powerlens._src.dynamics.linalg`), split over the heads by the least-squares rule, Gaussian
  queries/keys of inverse temperature beta. The spectrum is known by construction, so the
  principal subspaces are columns of Q (or S), never an ``eig``;
* a model (``[model]``): each listed layer iterated as a shared-weight system over the
  prompts (:func:`model_systems`, host side, ``spectra_of`` for the subspaces);
* ``builder = "module:function"``: any host function ``fn(point, seeds, spec) -> Systems``
  for the R replicates of one point (``point`` maps every key to its value; see
  :func:`from_layers` to make one from :class:`~powerlens._src.dynamics.params.Layers`). A
  builder is user code, imported and run as it is (:func:`host_builder`: from an installed
  module, or from the file ``builder_path`` names, never from the current directory).

:func:`synthetic_builder` is the one compiled builder of synthetic systems on their own
(rebuilding rows: :meth:`~powerlens._src.sweeps.engine.Engine.systems_of`, ``pl.sweep_system``).

Eigenvalue groups follow one rule (:func:`powerlens._src.dynamics.linalg.group_size`, tolerance
``GROUP_RTOL``): the principal group is every eigenvalue whose key (|1+lambda| shifted,
|lambda| plain) is within it of the largest; lambda_2 is the first eigenvalue after it,
lambda_3 the first after lambda_2's group.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from ..dynamics import struct

from ..analysis.spectra import reference_subspaces, spectra_of, sweep_subspaces
from ..dynamics.params import LayerConfig, Layers
from ..dynamics.schedule import Schedule
from ..dynamics.subspaces import REFERENCES, Subspaces, stack_subspaces
from ..dynamics.sweep import stack_systems
from ..dynamics.linalg import group_size
from ..dynamics.synthetic import SyntheticConfig, synthetic as build_synthetic
from .sources import builder_file, host_builder, model_layers  # noqa: F401  (re-exported)
from .sources import loaded_model as _model   # one cache for the spec's checks and the rows


@struct.dataclass
class Systems:
    """One system (add a leading axis S for a batch).

    Attributes:
      layers: :class:`Layers` with one unique layer and the schedule ``Schedule.repeat(0, T)``.
      x0: "float[n d]" initial tokens; valid: "bool[n]".
      subspaces: the references of the alignment measures ("float[1 m d k]"), principal in
        the spec's ``order``.
      direction: "float[d k1]" orthonormal basis of the shifted principal subspace
        (zero-padded): the direction rate is the approach of the token mean to it.
      top2: "float[d k2]" basis of the principal and the next eigenvalue group (the
        ``top2`` rate), or None.
      v1: "float[d]" the principal direction for the bipartite measures (zeros unless the
        principal subspace is one real direction).
      lam: "float[3 2]" (re, im) of lambda_1, lambda_2, lambda_3 in the shifted order (NaN
        where there is none), Im >= 0.
      dim: "int[]" dimension of the shifted principal group.
      x0_exact: "float[n d]" the exact bipartite start (+-v1), or None.
    """

    layers: Layers
    x0: jax.Array
    valid: jax.Array
    subspaces: Subspaces
    direction: jax.Array
    v1: jax.Array
    lam: jax.Array
    dim: jax.Array
    top2: Optional[jax.Array] = None
    x0_exact: Optional[jax.Array] = None


@dataclasses.dataclass(frozen=True)
class Static:
    """What one compiled program depends on: a group's static keys (hashable)."""

    d: Optional[int]
    tokens: Optional[int]
    heads: Optional[int]
    kind: Optional[str]
    spectrum: Optional[str]
    init: Optional[str]
    steps: int
    attention: str
    rule: str
    order: str
    keep_bias: bool
    x64: bool
    series: Tuple[str, ...] = ()

    @property
    def dtype(self):
        return jnp.float64 if self.x64 else jnp.float32

    @property
    def synthetic(self) -> SyntheticConfig:
        """The static shape of this group's synthetic systems."""
        return SyntheticConfig(d=self.d, tokens=self.tokens, heads=self.heads, kind=self.kind,
                               spectrum=self.spectrum, init=self.init, steps=self.steps, order=self.order,
                               x64=self.x64)


# ------------------------------------------------------------------ synthetic, on the device

def synthetic_systems(seed, p: Dict[str, Any], st: Static) -> Systems:
    """One synthetic system from its seed "int[]" and dynamic values ``p`` (beta, top, rest,
    imag, pair, nonnormality, cone, noise; ranges "float[2]"): the system and facts of
    :func:`powerlens._src.dynamics.synthetic.synthetic`, arranged for the measures. Pure: vmap and jit it."""
    return arranged(*build_synthetic(seed, p, st.synthetic), st.tokens)


def arranged(layers: Layers, f: Dict[str, Any], tokens: int) -> Systems:
    """The system and facts of :func:`powerlens._src.dynamics.synthetic.synthetic` arranged for the
    measures (one system of ``tokens`` tokens, all valid)."""
    return Systems(layers=layers, x0=f["x0"], valid=jnp.ones(tokens, bool), subspaces=synthetic_subspaces(f),
                   direction=f["direction"], v1=f["v1"], lam=f["lam"], dim=f["dim"], top2=f["top2"],
                   x0_exact=f["x0_exact"])


@functools.lru_cache(maxsize=64)
def synthetic_builder(cfg: SyntheticConfig) -> Callable:
    """The one compiled builder of synthetic systems of the static shape ``cfg``, shared by the
    sweep engine (:meth:`~powerlens._src.sweeps.engine.Engine.systems_of`) and
    :func:`powerlens._src.sweeps.api.sweep_system`: cached by ``cfg``, so a second call with the
    same shapes runs the program traced by the first.

    ``fn(slots, seeds, values) -> (systems, facts)``: seeds "int32[S]", values ``{key: "float[S ...]"}``
    (the dynamic keys), slots an explicit spectrum's "float[d 2]" shared by every system
    (``cfg.spectrum == "eigenvalues"``; None otherwise); :func:`arranged` systems and every
    fact of :func:`powerlens._src.dynamics.synthetic.synthetic`, with a leading axis S.
    Call it inside ``jax.enable_x64(cfg.x64)``."""
    def one(slots, seed, p):
        q = p if slots is None else {**p, "eigenvalues": slots}
        layers, f = build_synthetic(seed, q, cfg)
        return arranged(layers, f, cfg.tokens), f
    return jax.jit(jax.vmap(one, in_axes=(None, 0, 0)))


def synthetic_subspaces(facts) -> Subspaces:
    """The references of a synthetic system's alignment measures ("float[1 m d k1]", in
    :data:`REFERENCES` order) from its facts: the principal basis, the random control of the
    same dimension, no other layer."""
    P, pdim = facts["principal"], facts["principal_dim"]
    return Subspaces(basis=jnp.stack([P, facts["random"], jnp.zeros_like(P)])[None],
                     dim=jnp.stack([pdim, pdim, 0]).astype(jnp.int32)[None], names=REFERENCES)


# ------------------------------------------------------------------ host builders

def _canonical(z: complex) -> complex:
    return complex(z.real, abs(z.imag))


def spectral_lambdas(shifted) -> np.ndarray:
    """"float[3 2]" lambda_1, lambda_2, lambda_3 of an :class:`OrderedSpectrum` (shifted)."""
    ev = np.asarray(shifted.eigenvalues)
    keys = np.abs(1.0 + ev)
    out = np.full((3, 2), np.nan)
    out[0] = [shifted.top.real, shifted.top.imag]
    i2 = shifted.dim
    if i2 < ev.size:
        out[1] = [_canonical(ev[i2]).real, _canonical(ev[i2]).imag]
        j = i2 + int(group_size(keys, i2))
        if j < ev.size:
            out[2] = [_canonical(ev[j]).real, _canonical(ev[j]).imag]
    return out


def _pad_columns(mats, k: Optional[int] = None) -> np.ndarray:
    """Stack "float[d k_i]" bases zero-padded to a common width."""
    k = max(max(m.shape[1] for m in mats), 1) if k is None else k
    return np.stack([np.pad(m, [(0, 0), (0, k - m.shape[1])]) for m in mats])


def from_layers(systems: Sequence[Layers], x0, valid=None, *, order: str = "shifted", seed: int = 0,
                spectra=None, subspaces: Optional[Subspaces] = None, direction=None, top2=None, v1=None,
                lam=None, x0_exact=None) -> Systems:
    """A batch of S host-built systems, with their spectral information from ``spectra_of``
    unless given.

    Args:
      systems: S one-layer :class:`Layers` of equal static config.
      x0: "float[S n d]"; valid: "bool[S n]" (default all valid).
      order, seed: of the reference subspaces (:func:`~powerlens._src.analysis.spectra.sweep_subspaces`:
        system i uses seed ``seed + i``), unless ``spectra`` and ``subspaces`` are given.
      direction, top2: "float[S d k]" bases (default: the shifted principal basis; no top2).
      v1: "float[S d]" (default: the principal direction where it is one real direction); v1 and
        lam stay float64 on the host (the bipartite measures square cosines near 1).
      lam: "float[S 3 2]" (default: from the shifted spectra). x0_exact: "float[S n d]" or None.
    """
    if spectra is None or subspaces is None:
        spectra, subspaces = sweep_subspaces(systems, order=order, seed=seed)
    sh = [sp[0].shifted for sp in spectra]
    if direction is None:
        direction = _pad_columns([s.basis for s in sh])
    if v1 is None:
        v1 = np.stack([s.basis[:, 0] if s.dim == 1 else np.zeros(s.basis.shape[0]) for s in sh])
    if lam is None:
        lam = np.stack([spectral_lambdas(s) for s in sh])
    x0 = np.asarray(x0)
    valid = np.ones(x0.shape[:2], bool) if valid is None else np.asarray(valid, bool)
    dt = np.asarray(systems[0].W_v).dtype
    cast = lambda a: None if a is None else np.asarray(a, dt)
    return Systems(layers=stack_systems(systems), x0=cast(x0), valid=valid, subspaces=subspaces,
                   direction=cast(direction), v1=np.asarray(v1, np.float64), lam=np.asarray(lam, np.float64),
                   dim=np.array([s.dim for s in sh], np.int32), top2=cast(top2), x0_exact=cast(x0_exact))


def concat(batches: Sequence[Systems]) -> Systems:
    """Concatenate batches of one group along the system axis; bases are zero-padded on
    their last axis to the widest (every other array already has equal shapes)."""
    def cat(*leaves):
        a = [np.asarray(x) for x in leaves]
        k = max(x.shape[-1] for x in a)
        return np.concatenate([np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, k - x.shape[-1])]) for x in a])
    return batches[0] if len(batches) == 1 else jax.tree_util.tree_map(cat, *batches)


def spec_builder(spec) -> Callable:
    """The custom builder of a spec (its ``builder_path`` relative to the spec's folder)."""
    return host_builder(spec.system["builder"], builder_file(spec.system.get("builder_path", ""), spec.source))


def call_builder(fn: Callable, point: Dict[str, Any], seeds, spec) -> "Systems":
    """``fn(point, seeds, spec)``, checked: a Systems with one system per replicate; anything
    else (or a failure inside it) is one ValueError naming the builder and the point."""
    where = f"{spec.source}: [system] builder {spec.system.get('builder')!r}"
    try:
        out = fn(point, seeds, spec)
    except Exception as exc:
        raise ValueError(f"{where} failed at point {point.get('point')} ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:300]})") from None
    if not isinstance(out, Systems):
        raise ValueError(f"{where} returned a {type(out).__name__}, not a powerlens._src.sweeps.systems.Systems "
                         f"(make one with from_layers)")
    n = np.shape(out.x0)[0] if np.ndim(out.x0) == 3 else None
    if n != len(seeds):
        raise ValueError(f"{where} returned x0 of shape {np.shape(out.x0)} at point {point.get('point')}; "
                         f"expected ({len(seeds)}, n, d): one system per replicate")
    return out


# ------------------------------------------------------------------ model sweeps

@functools.lru_cache(maxsize=4)
def _model_inputs(name: str, prompts: Tuple[str, ...]):
    from ..models.embed import embed
    x0, valid = embed(_model(name), list(prompts))
    return np.asarray(x0), np.asarray(valid, bool)


@functools.lru_cache(maxsize=256)
def _model_spectrum(name: str, layer: int):
    return spectra_of(_model(name).layers.shared(layer, 1))


def check_model(spec) -> Dict[str, int]:
    """Everything a model sweep needs, before it runs: the model (loaded), its layers, the
    prompts (embedded: a prompt too long for the model is refused here). Returns the shapes
    of its systems (d, tokens, heads, d_head, kv_heads) for the memory estimate."""
    name, prompts = spec.model["name"], tuple(spec.model["prompts"])
    model_layers(spec)
    try:
        x0, _ = _model_inputs(name, prompts)
    except ValueError as exc:
        raise ValueError(f"{spec.source}: [model] prompts: {' '.join(str(exc).split())}") from None
    cfg = _model(name).layers.config
    return {"d": cfg.d_model, "tokens": int(x0.shape[1]), "heads": cfg.n_heads, "d_head": cfg.d_head,
            "kv_heads": cfg.n_kv_heads}


def model_systems(point: Dict[str, Any], seeds, spec) -> Systems:
    """The prompts of one point of a model sweep: layer ``point["layer"]`` iterated
    ``point["steps"]`` times as a shared-weight system, one system per prompt."""
    name, prompts = spec.model["name"], tuple(spec.model["prompts"])
    model = _model(name)
    layer = int(point["layer"])
    if not 0 <= layer < model.layers.n_unique:          # model_layers made the spec's 0-based
        raise ValueError(f"{spec.source}: [model] layers: layer {layer} does not exist "
                         f"({name} has {model.layers.n_unique} unique layers: 0..{model.layers.n_unique - 1})")
    dt = np.float64 if point["x64"] else np.float32
    one = jax.tree_util.tree_map(lambda a: np.asarray(a, dt) if np.issubdtype(np.asarray(a).dtype, np.floating)
                                 else np.asarray(a), model.layers.shared(layer, int(point["steps"])))
    spectra = _model_spectrum(name, layer)
    subs = reference_subspaces(spectra, order=point["order"], seed=spec.seed, dtype=dt)
    P = len(prompts)
    x0, valid = _model_inputs(name, prompts)
    return from_layers([one] * P, x0, valid, spectra=[spectra] * P, subspaces=stack_subspaces([subs] * P))
