"""Layer parameters: a pytree of stacked arrays, built from parts, plus a hashable static config.

:class:`Layers` holds three parts (:mod:`powerlens._src.dynamics.parts`), each with its own shapes
and sharding rule (U = number of *unique* layers, H = query heads, G = key/value heads,
e = d_head, d = model width, f = FFN width)::

    attn   Attention   W_q (U, H, e, d)  W_k, W_v (U, G, e, d)  W_o (U, d, H*e)
                       b_q (U, H, e)  b_k, b_v (U, G, e)  b_o (U, d)
                       scale (U,) softmax scale   window (U,) int, local window (0 = global)
                       q/k_norm_scale, q/k_norm_bias (U, e)   rope_base (U,)
    norms  Norms       norm_scale / norm_bias, ffn_norm_scale / ffn_norm_bias,
                       post_attn_norm_scale / post_ffn_norm_scale (U, d), any absent
    ffn    FFN | None  W_in, W_gate (U, f, d)  b_in (U, f)  W_out (U, d, f)  b_out (U, d);
                       None when the family or the load has no FFN (rule ``full`` needs it)

Every array is also read by its flat name (``layers.W_o``, ``layers.W_in``; :data:`FIELDS`).

Column-vector maths: a token x maps to ``F x`` with
``F = sum_h O_h V_h = W_o @ concat_h(V_h)`` (d, d); with grouped-query attention
each query head h uses the value head ``h // (H // G)``.

The order in which the unique layers are applied is the static ``schedule`` of
the config, a compact :class:`~powerlens._src.dynamics.schedule.Schedule`: ``None`` means
``Schedule.range(U)`` (a layer-varying model); a shared-weight system is one layer with
``Schedule.repeat(0, T)`` (three integers, however large T); ALBERT's layer groups are a
short explicit tuple of group indices. Weights are never tiled.

Dtypes: the arrays keep the dtype they were stored in (a bf16 checkpoint stays bf16, the
softmax scale and RoPE bases at least float32). ``config.compute_dtype`` is what a step
computes in (None: the weights' own dtype): :func:`~powerlens._src.dynamics.run.run` casts each
layer's weights to it inside the scan step (:func:`cast_layer`), so at most one layer is
ever upcast. ``config.precision`` is the matmul precision of every step
(``jax.default_matmul_precision``; default ``"highest"``, full float32, never TF32).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from . import struct

from .parts import FFN, PARTS, Attention, Norms
from .schedule import Schedule
from jaxtyping import Array, Float

NORMS = ("l2", "layernorm", "rmsnorm")
FFN_ACTIVATIONS = ("gelu", "gelu_new", "relu", "silu_glu", "gelu_glu")
SANDWICH_NORMS = ("post_attn_norm_scale", "post_ffn_norm_scale")


PRECISIONS = ("highest", "high", "default", "float32", "tensorfloat32", "bfloat16")
"""Matmul precisions ``LayerConfig.precision`` accepts (``jax.default_matmul_precision``)."""


def wide(a):
    """A dtype, or an array cast to it, of at least float32 precision (float64 stays)."""
    if isinstance(a, (np.dtype, type, str)):
        return np.promote_types(np.dtype(a), np.float32)
    dt = np.promote_types(a.dtype, np.float32)
    return a if a.dtype == dt else (a.astype(dt) if isinstance(a, (np.ndarray, jax.Array)) else jnp.asarray(a, dt))


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """Static (hashable) facts about a stack of attention layers: the maths only.

    How a run computes them (dense, blocked or fused attention) is the run's choice,
    :attr:`powerlens.Dynamics.attention_block`; the model's family is
    :attr:`powerlens._src.models.base.ModelInfo.family`.

    Attributes:
      d_model, n_heads, n_kv_heads, d_head: sizes.
      causal: decoder mask (token i sees j <= i).
      norm: the model's own norm kind (``layernorm`` or ``rmsnorm``; ``l2`` for
        synthetic systems) used by the ``post_ln``/``pre_ln``/``full`` rules.
      norm_eps: epsilon of that norm.
      norm_placement: ``post`` (BERT/ALBERT) or ``pre`` (GPT-2/GPT-Neo/Llama);
        chooses the faithful rule and the ``full`` block.
      rope_theta: RoPE base, ``None`` for no rotary embedding.
      rope_dim: number of rotated dimensions per head (``None`` = all).
      ffn_activation: activation of the FFN for rule ``full`` (``None`` if absent).
      schedule: the unique-layer index of each step, a :class:`Schedule` (any sequence of
        ints is converted; ``None`` = one step per unique layer).
      attn_softcap: attention-logit soft-capping (Gemma 2): each score s = scale q.k becomes
        cap * tanh(s / cap) before the mask and the softmax; ``None`` = off.
      parallel_residual: the ``full`` block of a ``pre`` model is parallel (GPT-NeoX with
        ``use_parallel_residual``, Phi): X + attn(LN1 X) + FFN(LN2 X), LN2 the ``ffn_norm``
        (absent: the one shared ``norm``, as in Phi).
      compute_dtype: the dtype a step computes in (``"float32"``, ...), each layer's weights
        cast to it inside the scan step; ``None`` = the weights' own dtype.
      precision: matmul precision of a step (:data:`PRECISIONS`; default ``"highest"``).
    """

    d_model: int
    n_heads: int
    d_head: int
    n_kv_heads: Optional[int] = None
    causal: bool = False
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    norm_placement: str = "post"
    rope_theta: Optional[float] = None
    rope_dim: Optional[int] = None
    ffn_activation: Optional[str] = None
    schedule: Optional[Schedule] = None
    attn_softcap: Optional[float] = None
    parallel_residual: bool = False
    compute_dtype: Optional[str] = None
    precision: str = "highest"

    def __post_init__(self):
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.schedule is not None:
            object.__setattr__(self, "schedule", Schedule.of(self.schedule))
        if not isinstance(self.causal, (bool, np.bool_)) and not (
                isinstance(self.causal, np.ndarray) and self.causal.shape == () and self.causal.dtype == bool):
            raise ValueError(f"LayerConfig.causal must be a bool (True or False), got {self.causal!r}")
        object.__setattr__(self, "causal", bool(self.causal))
        for name in ("d_model", "n_heads", "d_head", "n_kv_heads"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"LayerConfig.{name} must be a positive integer, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LayerConfig: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.norm not in NORMS:
            raise ValueError(f"LayerConfig.norm must be one of {NORMS}, got {self.norm!r}")
        if self.norm_placement not in ("post", "pre"):
            raise ValueError(f"LayerConfig.norm_placement must be 'post' or 'pre', got {self.norm_placement!r}")
        if not isinstance(self.parallel_residual, (bool, np.bool_)) or (self.parallel_residual and
                                                                         self.norm_placement != "pre"):
            raise ValueError(f"LayerConfig.parallel_residual must be a bool, and True only with norm_placement "
                             f"'pre', got {self.parallel_residual!r} with {self.norm_placement!r}")
        object.__setattr__(self, "parallel_residual", bool(self.parallel_residual))
        if self.attn_softcap is not None and (isinstance(self.attn_softcap, (bool, np.bool_)) or not isinstance(
                self.attn_softcap, (int, float, np.number)) or not 0 < self.attn_softcap < np.inf):
            raise ValueError(f"LayerConfig.attn_softcap must be a positive number or None, got {self.attn_softcap!r}")
        if self.rope_theta is not None and (isinstance(self.rope_theta, (bool, np.bool_)) or not isinstance(
                self.rope_theta, (int, float, np.number)) or not 0 < self.rope_theta < np.inf):
            raise ValueError(f"LayerConfig.rope_theta must be a positive finite number or None, "
                             f"got {self.rope_theta!r}")
        if self.ffn_activation is not None and self.ffn_activation not in FFN_ACTIVATIONS:
            raise ValueError(
                f"LayerConfig.ffn_activation must be one of {FFN_ACTIVATIONS}, got {self.ffn_activation!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"LayerConfig.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.compute_dtype is not None:
            name = getattr(jnp.dtype(self.compute_dtype), "name", None) if isinstance(
                self.compute_dtype, (str, np.dtype, type)) else None
            if name not in ("float64", "float32", "float16", "bfloat16"):
                raise ValueError(f"LayerConfig.compute_dtype must be a float dtype name (float32, float64, "
                                 f"bfloat16, float16) or None, got {self.compute_dtype!r}")
            object.__setattr__(self, "compute_dtype", name)

    @property
    def kv_group(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads

    def steps_for(self, n_unique: int) -> Schedule:
        """The schedule, defaulting to one step per unique layer."""
        return self.schedule if self.schedule is not None else Schedule.range(n_unique)


FIELDS = ("W_q", "W_k", "W_v", "W_o", "scale", "window", "b_q", "b_k", "b_v", "b_o", "norm_scale", "norm_bias",
          "ffn_norm_scale", "ffn_norm_bias", "W_in", "b_in", "W_gate", "W_out", "b_out", "q_norm_scale",
          "k_norm_scale", "q_norm_bias", "k_norm_bias", "post_attn_norm_scale", "post_ffn_norm_scale", "rope_base")
"""Every array of :class:`Layers` by its flat name, in a fixed order (the weights of one layer are
hashed in it: :func:`powerlens._src.steering.edit_file.layer_sha256`)."""

PART_OF = {name: part for part, cls in PARTS.items() for name in cls.names()}
"""The part (``attn``, ``norms``, ``ffn``: a field of :class:`Layers`) that holds each flat name."""


@struct.dataclass
class Layers:
    """Stacked parameters of U unique attention layers, built from parts (see module docstring):

        attn  :class:`~powerlens._src.dynamics.parts.Attention`   W_q, W_k, W_v, W_o, biases, scale, window,
                                                             q/k norms, RoPE bases
        norms :class:`~powerlens._src.dynamics.parts.Norms`       the sub-layers' norms (any may be absent)
        ffn   :class:`~powerlens._src.dynamics.parts.FFN` or None  None: the family or the load has no FFN
        config :class:`LayerConfig`                         static

    Every array is also read by its flat name (``layers.W_o`` is ``layers.attn.W_o``,
    ``layers.W_in`` is ``layers.ffn.W_in`` or None without an FFN), and ``replace`` takes flat
    names too (``layers.replace(W_o=...)`` replaces the attention part's W_o; an FFN array given
    to layers without an FFN creates the part). Build validated layers with :func:`make_layers`.
    """

    attn: Attention
    norms: Norms = struct.field(default_factory=Norms)
    ffn: Optional[FFN] = None
    config: LayerConfig = struct.field(pytree_node=False, default=None)

    def arrays(self) -> dict:
        """Every array present, by flat name, in the order of :data:`FIELDS`."""
        return {k: a for k in FIELDS if (a := getattr(self, k)) is not None}

    @property
    def n_unique(self) -> int:
        return int(self.W_v.shape[0])

    @property
    def dtype(self):
        """The dtype the layers compute in: ``config.compute_dtype``, else the dtype of W_v."""
        cd = self.config.compute_dtype if self.config is not None else None
        return jnp.dtype(cd) if cd is not None else self.W_v.dtype

    @property
    def storage_dtype(self):
        """The dtype the weights are held in (that of W_v)."""
        return self.W_v.dtype

    @property
    def schedule(self) -> Schedule:
        return self.config.steps_for(self.n_unique)

    def layer(self, i) -> "Layer":
        """The parameters of unique layer ``i`` with the leading axis removed (one compiled
        gather for every array, ``i`` a traced or a Python index)."""
        return _take_layer(self, i)

    def with_schedule(self, schedule) -> "Layers":
        """The same layers applied in the order ``schedule`` (a sequence of unique-layer
        indices or a :class:`Schedule`; validated without expanding a compact one)."""
        sched = Schedule.of(schedule)
        lo, hi = sched.bounds()
        if lo < 0 or hi >= self.n_unique:
            bad = sorted({s for s in (lo, hi) if not 0 <= s < self.n_unique}) if sched.arithmetic else \
                sorted({s for s in sched if not 0 <= s < self.n_unique})
            raise ValueError(f"schedule refers to layer(s) {bad} but only {self.n_unique} exist")
        return self.replace(config=dataclasses.replace(self.config, schedule=sched))

    def select(self, schedule) -> "Layers":
        """Only the unique layers that ``schedule`` (indices or a :class:`Schedule`) applies,
        with the schedule renumbered onto them: the same dynamics without the unused layers' arrays."""
        used, renumbered = Schedule.of(schedule).renumbered()
        lo = int(used[0])
        # consecutive layers are a slice (a contiguous copy; in a compiled call a gather of the
        # same arrays took 2-5x longer), any other selection a gather
        at = slice(lo, lo + len(used)) if list(used) == list(range(lo, lo + len(used))) else np.asarray(used)
        sub = jax.tree_util.tree_map(lambda a: a[at], self)
        return sub.replace(config=dataclasses.replace(self.config, schedule=renumbered))

    def shared(self, layer: int, steps: int) -> "Layers":
        """Unique layer ``layer`` iterated ``steps`` times as a shared-weight system.

        Only that layer's arrays are kept (one copy) and the schedule is
        ``Schedule.repeat(0, steps)``: O(1) however many steps.
        """
        check_steps(steps)
        if not -self.n_unique <= layer < self.n_unique:
            raise ValueError(f"shared layer index {layer} out of range for {self.n_unique} layers")
        one = _keep_layer(self, layer % self.n_unique)
        return one.replace(config=dataclasses.replace(self.config, schedule=Schedule.repeat(0, steps)))


def _flat(part: str, name: str):
    def get(self):
        p = getattr(self, part)
        return None if p is None else getattr(p, name)
    return property(get, doc=f"``{part}.{name}`` (None when absent).")


for _name, _part in PART_OF.items():
    setattr(Layers, _name, _flat(_part, _name))
del _name, _part


def _replace_layers(self, **changes) -> "Layers":
    """A copy with fields replaced: the parts and ``config`` by their names, any array by its flat
    name (:data:`FIELDS`) routed to its part; an FFN array given to layers without an FFN creates
    the part (an FFN set to None stays an FFN with None arrays)."""
    own = {k: changes.pop(k) for k in ("attn", "norms", "ffn", "config") if k in changes}
    unknown = sorted(set(changes) - set(PART_OF))
    if unknown:
        raise TypeError(f"Layers.replace: unknown field(s) {unknown}")
    for part, cls in PARTS.items():
        sub = {k: v for k, v in changes.items() if PART_OF[k] == part}
        if not sub:
            continue
        current = own.get(part, getattr(self, part))
        if current is None:
            if all(v is None for v in sub.values()):
                continue
            current = cls(**{k: None for k in cls.names()})
        own[part] = dataclasses.replace(current, **sub)
    return dataclasses.replace(self, **own)


Layers.replace = _replace_layers


@jax.jit
def _take_layer(layers: Layers, i) -> Layers:
    return jax.tree_util.tree_map(lambda a: a[i], layers)


@jax.jit
def _keep_layer(layers: Layers, i) -> Layers:
    """The arrays of unique layer ``i`` with a leading axis of length 1."""
    return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_slice_in_dim(a, i, 1), layers)


Layer = Layers
"""One unique layer: a :class:`Layers` with the leading axis removed (``layers.layer(u)``),
so W_q "float[H e d]", W_o "float[d H*e]", scale "float[]", and so on (module docstring)."""


MODEL_SPLIT = {name: PARTS[PART_OF[name]].SPLIT[name] for name in FIELDS}
"""Each part's sharding rule (``SPLIT`` of :class:`~powerlens._src.dynamics.parts.Attention`,
:class:`~powerlens._src.dynamics.parts.Norms`, :class:`~powerlens._src.dynamics.parts.FFN`: the rules live
there) listed by flat name: ``(axis, count)`` split over the mesh's ``model`` axis, None replicated."""


def cast_layer(lp: Layers, dtype) -> Layers:
    """``lp`` with every floating array cast to ``dtype`` (integer arrays, e.g. ``window``, and
    arrays already of ``dtype`` as they are): one layer upcast inside a scan step."""
    dtype = jnp.dtype(dtype)
    return jax.tree_util.tree_map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != dtype else a, lp)


def all_finite(a) -> bool:
    """Whether every value of ``a`` is finite, checked one leading slice at a time (float16 and
    bfloat16 in float32), so no boolean or widened copy of the whole array is made."""
    h = np.asarray(a)
    wide_ = h.dtype.itemsize < 4
    parts = h.reshape((h.shape[0] if h.ndim else 1, -1))
    return all(bool(np.isfinite(p.astype(np.float32) if wide_ else p).all()) for p in parts)


def check_steps(steps) -> int:
    if not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or steps <= 0:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    return int(steps)


def _computed(layers: Layers, a):
    """``a`` (a weight of ``layers``) in the layers' compute dtype: itself when it is stored in it."""
    dt = layers.dtype
    return a if a.dtype == dt else a.astype(dt)


def value_matrix(layers: Layers) -> jax.Array:
    """V_cat expanded to the query heads: "float[U H*e d]" ("float[H*e d]" for one
    :class:`Layer`).

    With grouped-query attention key/value head g serves query heads
    ``g*group, ..., g*group + group - 1`` (Hugging Face ``repeat_kv`` order).
    """
    cfg = layers.config
    W_v = jnp.repeat(_computed(layers, layers.W_v), cfg.kv_group, axis=-3)  # (U, H, e, d)
    H, e, d = W_v.shape[-3:]
    return W_v.reshape(W_v.shape[:-3] + (H * e, d))


def layer_matrices(layers: Layers) -> Float[Array, "U d d"]:
    """F_t = W_o @ V_cat for every unique layer: "float[U d d]", in the layers' compute dtype."""
    return jnp.einsum("udk,ukc->udc", _computed(layers, layers.W_o), value_matrix(layers))


def layer_factors(layers: Layers):
    """F_t = A_t B_t with the inner size r = G*e of the key/value heads: A "float[U d r]" (W_o
    with the columns of the query heads that share a key/value head summed), B "float[U r d]"
    (W_v of the G key/value heads); "float[d r]" and "float[r d]" for one :class:`Layer`.
    With grouped-query attention r < d (SmolLM2: 192 against 576), and the nonzero
    eigenvalues of F_t are those of the r x r matrix B_t A_t."""
    cfg = layers.config
    G, e = cfg.n_kv_heads, cfg.d_head
    lead = layers.W_o.shape[:-1]                                       # (U, d) or (d,)
    W_o, W_v = _computed(layers, layers.W_o), _computed(layers, layers.W_v)
    A = W_o.reshape(lead + (G, cfg.kv_group, e)).sum(axis=-2).reshape(lead + (G * e,))
    return A, W_v.reshape(W_v.shape[:-3] + (G * e, W_v.shape[-1]))


def constant_term(layers: Layers) -> Float[Array, "U d"]:
    """c = O b_v + b_o "float[U d]": the part of the attention output that does not depend on X."""
    U, d = layers.W_o.shape[0], layers.W_o.shape[1]
    c = jnp.zeros((U, d), layers.W_o.dtype)
    if layers.b_v is not None:
        b_v = jnp.repeat(layers.b_v, layers.config.kv_group, axis=-2).reshape(U, -1)
        c = c + jnp.einsum("udk,uk->ud", layers.W_o, b_v)
    if layers.b_o is not None:
        c = c + layers.b_o
    return c


def _ffn_shapes(arrays: dict, U: int, d: int) -> dict:
    """Expected shapes of the FFN arrays, with f read off W_in (or W_out when W_in is absent)."""
    W_in, W_out = arrays.get("W_in"), arrays.get("W_out")
    if W_in is not None:
        if np.ndim(W_in) != 3:
            raise ValueError(f"W_in must have shape (L, f, d), got {tuple(np.shape(W_in))}")
        f = np.shape(W_in)[1]
    elif W_out is not None:
        if np.ndim(W_out) != 3:
            raise ValueError(f"W_out must have shape (L, d, f), got {tuple(np.shape(W_out))}")
        f = np.shape(W_out)[2]
    else:
        return {}
    return {"W_in": (U, f, d), "b_in": (U, f), "W_gate": (U, f, d), "W_out": (U, d, f), "b_out": (U, d)}


def real_array(name: str, a):
    """``a`` (an array, returned as is, or a list or scalar, as a NumPy array) after checking
    that it holds real numbers (float or integer): a complex, bool, string or object array
    is an error naming ``name``, never a cast."""
    if not isinstance(a, (np.ndarray, jax.Array)):
        try:
            a = np.asarray(a)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be an array of real numbers, got {type(a).__name__}") from None
    if a.dtype == bool or not (jnp.issubdtype(a.dtype, np.floating) or jnp.issubdtype(a.dtype, np.integer)):
        raise ValueError(f"{name} must be an array of real numbers (float or integer), got dtype {a.dtype}")
    return a


def check_window(window, U: int) -> jax.Array:
    """The local-attention window of each layer "int32[U]": integers >= 0 (0 = global)."""
    if window is None:
        return jax.device_put(np.zeros((U,), np.int32))        # no program (jnp.zeros compiles two)
    w = real_array("window", window)
    if not np.issubdtype(w.dtype, np.integer):
        raise ValueError(f"window must be an integer >= 0 (0 = global attention), got dtype {w.dtype}")
    if np.any(w < 0):
        raise ValueError(f"window must be an integer >= 0 (0 = global attention), got {w.min()}")
    if np.any(w > np.iinfo(np.int32).max):
        raise ValueError(f"window {w.max()} does not fit an int32")
    try:
        return jnp.broadcast_to(jnp.asarray(w, jnp.int32), (U,))
    except ValueError:
        raise ValueError(f"window has shape {w.shape}, expected () or ({U},)") from None


def make_layers(W_v=None, W_o=None, *, W_q=None, W_k=None, scale=None, window=None, config=None,
                attn: Optional[Attention] = None, norms: Optional[Norms] = None, ffn: Optional[FFN] = None,
                **arrays) -> Layers:
    """Build validated :class:`Layers` from its parts (``attn``, ``norms``, ``ffn``: what the
    converters give) or from per-layer arrays by flat name (W_v, W_o, ..., each routed to its
    part); a leading layer axis is required either way. ``ffn`` None (or no FFN array): the
    layers have no FFN; an FFN part needs W_in and W_out.

    ``config`` defaults to a synthetic ``l2`` system with sizes read off the shapes.
    Every shape is checked (the FFN width f is read off W_in, or W_out without W_in), every
    array must be real (float or integer: complex, bool, string or object arrays are
    refused, not cast) and finite, and ``window`` an integer >= 0; errors name the array.
    """
    if attn is not None or norms is not None or ffn is not None:
        flat = dict(arrays, W_v=W_v, W_o=W_o, W_q=W_q, W_k=W_k, scale=scale, window=window)
        given = sorted(k for k, v in flat.items() if v is not None)
        if given or attn is None:
            raise ValueError(f"make_layers: give the parts (attn=, norms=, ffn=) or flat arrays, not both "
                             f"(flat: {given})" if given else "make_layers: the parts need attn=")
        arrays = {**attn.arrays(), **(norms.arrays() if norms is not None else {}),
                  **(ffn.arrays() if ffn is not None else {})}
        W_v, W_o, W_q, W_k = arrays.pop("W_v"), arrays.pop("W_o"), arrays.pop("W_q", None), arrays.pop("W_k", None)
        scale, window = arrays.pop("scale", None), arrays.pop("window", None)
    if W_v is None or W_o is None:
        raise ValueError(f"make_layers: {'W_v' if W_v is None else 'W_o'} is required")
    W_v = jnp.asarray(real_array("W_v", W_v))
    W_o = jnp.asarray(real_array("W_o", W_o))
    if W_v.ndim != 4:
        raise ValueError(f"W_v must have shape (L, H, d_head, d), got {tuple(W_v.shape)}")
    U, G, e, d = W_v.shape
    if W_q is not None:
        W_q = jnp.asarray(real_array("W_q", W_q))
        if W_q.ndim != 4:
            raise ValueError(f"W_q must have shape (L, H, d_head, d), got {tuple(W_q.shape)}")
        H = W_q.shape[1]
    else:
        H = config.n_heads if config is not None else G
    if config is None:
        config = LayerConfig(d_model=d, n_heads=H, n_kv_heads=G, d_head=e, norm="l2")
    cfg = config
    expect = {
        "W_q": (U, cfg.n_heads, e, d), "W_k": (U, cfg.n_kv_heads, e, d), "W_v": (U, cfg.n_kv_heads, e, d),
        "W_o": (U, d, cfg.n_heads * e),
        "b_q": (U, cfg.n_heads, e), "b_k": (U, cfg.n_kv_heads, e), "b_v": (U, cfg.n_kv_heads, e), "b_o": (U, d),
        "norm_scale": (U, d), "norm_bias": (U, d), "ffn_norm_scale": (U, d), "ffn_norm_bias": (U, d),
        "q_norm_scale": (U, e), "k_norm_scale": (U, e), "q_norm_bias": (U, e), "k_norm_bias": (U, e),
        "post_attn_norm_scale": (U, d),
        "post_ffn_norm_scale": (U, d), "rope_base": (U,),
    }
    expect.update(_ffn_shapes(arrays, U, d))
    if (e, d) != (cfg.d_head, cfg.d_model):
        raise ValueError(f"W_v has d_head={e}, d={d} but the config says d_head={cfg.d_head}, d={cfg.d_model}")
    fields = dict(arrays, W_q=W_q, W_k=W_k, W_v=W_v, W_o=W_o)
    sdt = wide(W_v.dtype) if jnp.issubdtype(W_v.dtype, jnp.floating) else W_v.dtype   # never below float32
    if scale is None:
        scale = jax.device_put(np.full((U,), 1.0 / np.sqrt(e), sdt))     # no program (jnp.full compiles two)
    scale = jnp.broadcast_to(jnp.asarray(real_array("scale", scale), sdt), (U,))
    window = check_window(window, U)
    for name, a in list(fields.items()):
        if a is None:
            continue
        a = jnp.asarray(real_array(name, a))
        fields[name] = a
        if name in expect and tuple(a.shape) != expect[name]:
            raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {expect[name]}")
        if jnp.issubdtype(a.dtype, jnp.floating) and not all_finite(a):
            raise ValueError(f"{name} contains non-finite values (NaN or inf)")
    if not np.all(np.isfinite(np.asarray(scale))):
        raise ValueError("scale contains non-finite values")
    if fields.get("rope_base") is not None:
        if cfg.rope_theta is None:
            raise ValueError("rope_base is given but the config has no RoPE (rope_theta None)")
        if not np.all(np.asarray(fields["rope_base"]) > 0):
            raise ValueError("rope_base must be positive on every layer")
    if cfg.norm_placement == "post" and any(fields.get(k) is not None for k in SANDWICH_NORMS):
        raise ValueError(f"sandwich norms ({', '.join(SANDWICH_NORMS)}) need norm_placement 'pre'")
    fields.update(scale=scale, window=window)
    parts = {name: cls.take(fields) for name, cls in PARTS.items()}
    if fields:
        raise TypeError(f"make_layers: unknown array(s) {sorted(fields)}; expected some of {list(FIELDS)}")
    ffn_part = parts["ffn"]
    if ffn_part is not None and (ffn_part.W_in is None or ffn_part.W_out is None):
        raise ValueError(f"the FFN needs W_in and W_out; {'W_in' if ffn_part.W_in is None else 'W_out'} is missing "
                         f"(given: {sorted(ffn_part.arrays())})")
    layers = Layers(attn=parts["attn"], norms=parts["norms"] or Norms(), ffn=ffn_part, config=cfg)
    if cfg.schedule is not None:
        layers.with_schedule(cfg.schedule)  # validates indices
    return layers
