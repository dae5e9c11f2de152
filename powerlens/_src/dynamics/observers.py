"""Observers: what :func:`powerlens._src.dynamics.run` measures inside its scan.

An observer is a pure pair in the Optax style, plus an optional summary hook and an
optional form that measures every state at once::

    init(x0, valid, layers)            -> state
    update(state, x_before, x_after, step) -> (state, out)     once per step, inside the scan
    finish(state, outs)                -> result                outs: every ``out``, stacked over T
    of_states(states, valid, layers, schedule) -> result        the same result, from all the
                                                                states "float[T+1 n d]" and the
                                                                layer of each step "int[T]"

x0, x_before, x_after are one prompt's tokens "float[n d]", valid "bool[n]", ``layers`` the
stacked :class:`~powerlens._src.dynamics.params.Layers` and ``step`` a :class:`Step`. Nothing is
computed for an observer that is not asked for, and memory grows with the number of steps
only by what ``update`` returns. ``of_states`` is what :func:`~powerlens._src.dynamics.run` uses
with ``measure_after``: for small states, one vectorised measure of all T+1 states costs
~50 kernels in all instead of ~50 per step (measured: MiniLM 1 x 16, every measure, 3.1 ->
2.3 ms against 1.9 ms for the states alone). Every ready observer has it. Ready observers:

    alignment(subspaces)   gamma, gamma_before, rho "float[T m]" against the m named
                           references and the rotation "float[T]" in the principal plane
    consensus()            mu, rank-collapse residual, pairwise cosine "float[T+1]"
    states()               every state "float[T+1 n d]"
    finite()               is every valid token of each state finite and non-zero? "bool[T+1]"
    final()                the last state "float[n d]"
    attention_maps(layers, rule=...)  each step's attention weights per head "float[T H n n]"
                           (O(T H n^2) memory: ask for it only when you need the patterns)
    mean_tangent(basis)    tan of the angle of the valid tokens' mean to span(basis) "float[T+1]"
    plane_angle(basis)     each token's angle in the plane of basis[:, :2] "float[T+1 n]"

A measured run asks for one bundle, :func:`run_observers`: alignment, consensus, finite and
final (states on request), plus the caller's extras; ``simulate``, the sweep's per-system
measure and ``trace`` all run it.

Measures of a *state* (consensus, states) include the initial state at index 0, so they
have T+1 entries; measures of a *step* (alignment) have T.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from . import struct

from .attention import softmax_qkv, check_attention, key_bias, uniform_weights
from .cache import per_arrays
from .layer import norm_of, check_rule
from .linalg import pow2_scale, scaled_norm
from .measures import consensus_measures, masked_mean, mean_angle, unit_rows
from .params import layer_factors
from .subspaces import Subspaces, reference_index
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Real


class Step(NamedTuple):
    """What an observer's ``update`` sees of the step, besides the two states."""

    t: jax.Array        # int (): position in the schedule, 0 .. T-1
    layer: jax.Array    # int (): the unique layer applied at this step, schedule[t]
    valid: jax.Array    # bool[n]: False for padding tokens


def _outputs(state, outs):
    """The default ``finish``: the per-step outputs, stacked over the steps."""
    return outs


class Observer(NamedTuple):
    """A pure (init, update[, finish][, of_states]) tuple; see the module docstring for the
    signatures. ``of_states`` None: the observer only measures inside the scan."""

    init: Callable[..., Any]
    update: Callable[..., Tuple[Any, Any]]
    finish: Callable[[Any, Any], Any] = _outputs
    of_states: Optional[Callable[..., Any]] = None


def labelled(values: Float[ArrayLike, "*batch m"], names: Sequence[str]) -> Dict[str, Float[ArrayLike, "*batch"]]:
    """``{name: values[..., r]}``: measures against the m references, each under its name
    (``principal``, ``random``, ``other_layer``), instead of a bare vector."""
    if values.shape[-1] != len(names):
        raise ValueError(f"labelled: {values.shape[-1]} values on the last axis for {len(names)} names {tuple(names)}")
    return {name: values[..., r] for r, name in enumerate(names)}


# ------------------------------------------------------------------------ alignment

@struct.dataclass
class Alignment:
    """Alignment of the tokens with each layer's reference subspaces, per step t = 0..T-1.

    Attributes:
      gamma: "float[T m]" mean over valid tokens of gamma_i(x_{t+1}) against reference r of
        layer schedule[t] (NaN where that reference is undefined).
      gamma_before: "float[T m]" the same for x_t, the tokens entering the step.
      rho: "float[T m]" share of valid tokens with gamma_i(x_{t+1}) > gamma_i(x_t).
      rotation: "float[T]" mean angle step of the tokens in the plane of the ``rotation_in``
        reference, in [-pi, pi); NaN unless that reference is a 2-D complex-pair plane. The
        mean of the tokens' steps, each read within pi of their circular mean
        (:func:`~powerlens._src.dynamics.measures.mean_angle`), so that steps near +-pi, which
        rounding wraps to either side, do not move it.
      names: static tuple of the m reference names.
    """

    gamma: jax.Array
    gamma_before: jax.Array
    rho: jax.Array
    rotation: jax.Array
    names: Tuple[str, ...] = struct.field(pytree_node=False, default=())

    def index(self, name: str) -> int:
        return reference_index(self.names, name)

    def named(self, field: str = "gamma") -> Dict[str, jax.Array]:
        """``field`` (gamma, gamma_before or rho) per reference name: ``{"principal": "float[T]",
        "random": ..., "other_layer": ...}`` (:func:`labelled`)."""
        if field not in ("gamma", "gamma_before", "rho"):
            raise ValueError(f"Alignment.named: field must be gamma, gamma_before or rho, got {field!r}")
        return labelled(getattr(self, field), self.names)


def complex_pair_planes(subspaces: Subspaces, layers, p: int):
    """"bool[U]": is reference p of layer u a complex-pair plane?

    True when it is 2-D and the restriction T2 = B^T F B has complex eigenvalues: the
    discriminant of T2 is negative by more than rounding (|Im lambda| above 1e-5 of the
    block's scale), so a repeated real eigenvalue, whose discriminant is ~0, is not one.
    """
    B2 = subspaces.basis[:, p, :, :2]                                   # (U, d, 2)
    # T2 = (B2^T A)(B B2) through the factors F = A B (params.layer_factors): O(U d r) work;
    # forming F is O(U d^2 r) (SmolLM2: 11 GFLOP, more than the run of a 1 x 16 prompt)
    A, B = layer_factors(layers)                                        # (U, d, r), (U, r, d)
    T2 = jnp.einsum("udi,udr->uir", B2, A) @ jnp.einsum("urd,udj->urj", B, B2)

    def below(T):                       # disc < -tol, both quadratic in T
        disc = 0.25 * (T[:, 0, 0] - T[:, 1, 1]) ** 2 + T[:, 0, 1] * T[:, 1, 0]
        tol = (1e-5 * jnp.max(jnp.abs(T), axis=(1, 2))) ** 2
        return disc < -tol, jnp.isfinite(disc) & jnp.isfinite(tol)

    plain, ok = below(T2)               # where a square overflows: the same test on T2 / c (c a power of two)
    scaled, _ = below(T2 / pow2_scale(jnp.max(jnp.abs(T2), axis=(1, 2)))[:, None, None])
    return (subspaces.dim[:, p] == 2) & jnp.where(ok, plain, scaled)


def _rotation_reference(subspaces: Subspaces, rotation_in: str) -> Optional[int]:
    """The index of the reference whose plane the rotation is measured in (None: no plane)."""
    names, k = subspaces.names, subspaces.basis.shape[-1]
    return names.index(rotation_in) if rotation_in in names and k >= 2 else None


_planes_jit = jax.jit(complex_pair_planes, static_argnums=2)


def rotation_planes(subspaces: Subspaces, layers, *, rotation_in: str = "principal"):
    """:func:`complex_pair_planes` of the ``rotation_in`` reference, "bool[U]", computed once per
    concrete set of (basis, dim, W_o, W_v) arrays (:func:`~powerlens._src.dynamics.cache.per_arrays`);
    None when there is no such plane or the arrays are traced or NumPy. It reads every W_o
    (SmolLM2: 40 MB, 3.5 ms of a 15 ms 1 x 16 prompt), so the jitted entry points compute it
    here, once, and hand it to :func:`alignment`."""
    p = _rotation_reference(subspaces, rotation_in)
    if p is None:
        return None
    arrays = (subspaces.basis, subspaces.dim, layers.W_o, layers.W_v)
    return per_arrays(f"planes{p}", arrays, lambda: _planes_jit(subspaces, layers, p))


def alignment(subspaces: Subspaces, *, rotation_in: str = "principal",
              planes: Bool[ArrayLike, "U"] | None = None) -> Observer:
    """gamma, gamma_before, rho against every reference and the rotation (see :class:`Alignment`).

    ``planes``: :func:`rotation_planes` of these subspaces and the layers run, when computed
    already (else each run computes it from the layers: one read of every W_o).

    All m bases of a layer sit side by side in one "float[d m*k]" matrix, so one matmul
    projects the unit tokens (scale-free: :func:`~powerlens._src.dynamics.measures.unit_rows`) on
    all of them. Each state's unit tokens are computed once: with a single unique layer (a
    shared-weight system) the projection of x_{t+1} is carried to the next step, otherwise its
    unit tokens "float[n d]" are (and, measuring all states at once, every state is projected
    once).
    """
    U, m, d, k = subspaces.basis.shape
    names = subspaces.names
    p = _rotation_reference(subspaces, rotation_in)
    B_all = jnp.swapaxes(subspaces.basis, 1, 2).reshape(U, d, m * k)
    shared = U == 1

    def project_unit(X1, u):
        """gamma "float[m n]" of the unit tokens X1 "float[n d]" against every reference of layer
        u, and each token's angle in the plane "float[n]"."""
        C = (X1 @ B_all[u]).reshape(X1.shape[0], m, k)
        angle = None if p is None else jnp.arctan2(C[:, p, 1], C[:, p, 0])
        return jnp.linalg.norm(C, axis=-1).T, angle

    project = lambda X, u: project_unit(unit_rows(X), u)                # x_i / ||x_i||, scale-free

    def measure_step(before, after, u, valid, pair):
        """The :class:`Alignment` of one step from the projections of x_t and x_{t+1}."""
        (g0, a0), (g1, a1) = before, after
        defined = subspaces.dim[u] > 0                                  # (m,)
        nan = jnp.full((), jnp.nan, g1.dtype)
        if p is None:
            rot = nan
        else:
            rot = jnp.where(pair[u], mean_angle(a1 - a0, valid), nan)
        return Alignment(gamma=jnp.where(defined, masked_mean(g1, valid), jnp.nan),
                         gamma_before=jnp.where(defined, masked_mean(g0, valid), jnp.nan),
                         rho=jnp.where(defined, masked_mean((g1 > g0).astype(g1.dtype), valid), jnp.nan),
                         rotation=rot, names=names)

    def is_pair(layers):
        """"bool[U]": is the rotation reference of layer u a complex-pair plane (``planes`` when given)."""
        if p is None:
            return None
        return complex_pair_planes(subspaces, layers, p) if planes is None else planes

    def init(x0, valid, layers):
        pair = is_pair(layers)
        return pair, (project(x0, 0) if shared else unit_rows(x0))

    def update(state, X, Y, step):
        pair, prev = state                 # x_t's projection (shared), else its unit rows
        u = step.layer
        Y1 = unit_rows(Y)
        before = prev if shared else project_unit(prev, u)
        after = project_unit(Y1, u)
        return (pair, after if shared else Y1), measure_step(before, after, u, step.valid, pair)

    def of_states(S, valid, layers, schedule):
        pair = is_pair(layers)
        if shared:                                                      # each state projected once
            g, a = jax.vmap(project, (0, None))(S, 0)
            cut = lambda lo, hi: jax.tree_util.tree_map(lambda z: z[lo:hi], (g, a))
            before, after = cut(0, -1), cut(1, None)
        else:                                       # x_t and x_{t+1} on the bases of step t's layer
            S1 = jax.vmap(unit_rows)(S)
            before = jax.vmap(project_unit)(S1[:-1], schedule)
            after = jax.vmap(project_unit)(S1[1:], schedule)
        return jax.vmap(measure_step, (0, 0, 0, None, None))(before, after, schedule, valid, pair)

    return Observer(init, update, of_states=of_states)


# ------------------------------------------------------------------------ states

def _prepend(first, rest):
    """Put the initial state's value in front of the per-step values (leaf by leaf)."""
    return jax.tree_util.tree_map(lambda a0, a: jnp.concatenate([a0[None], a]), first, rest)


def per_state(measure: Callable[[Any, Any], Any]) -> Observer:
    """``measure(X, valid)`` of every state x_0 .. x_T, stacked over the T+1 states (index 0: x_0)."""
    return Observer(init=lambda x0, valid, layers: measure(x0, valid),
                    update=lambda first, X, Y, step: (first, measure(Y, step.valid)),
                    finish=_prepend,
                    of_states=lambda S, valid, layers, schedule: jax.vmap(measure, (0, None))(S, valid))


def consensus() -> Observer:
    """mu, the rank-collapse residual and the pairwise cosine of every state: a
    :class:`~powerlens._src.dynamics.measures.Consensus` of "float[T+1]" arrays."""
    return per_state(consensus_measures)


def states() -> Observer:
    """Every state x_0 .. x_T: "float[T+1 n d]"."""
    return per_state(lambda X, valid: X)


def _all_finite(X, valid):
    """Every valid token finite and non-zero (a zero token, e.g. N2 of an overflowed norm, has no
    direction): its largest |entry| is finite and positive (a NaN entry makes the max NaN). One
    reduction over the tokens, the one :func:`~powerlens._src.dynamics.measures.unit_rows` also takes."""
    top = jnp.max(jnp.abs(X), axis=-1)
    return jnp.all((jnp.isfinite(top) & (top > 0)) | ~valid)


def finite() -> Observer:
    """Whether every valid token of each state x_0 .. x_T is finite and non-zero: "bool[T+1]"
    (so that a caller names the first bad step instead of reporting numbers measured on inf,
    NaN or a token without a direction)."""
    return per_state(_all_finite)


def final() -> Observer:
    """The last state x_T: "float[n d]" (nothing is kept per step)."""
    return Observer(init=lambda x0, valid, layers: x0,
                    update=lambda last, X, Y, step: (Y, None),
                    finish=lambda last, outs: last,
                    of_states=lambda S, valid, layers, schedule: S[-1])


# ------------------------------------------------------------------------ tangents

def _mean_tangent(basis: Float[ArrayLike, "d k"]) -> Callable:
    """tan of the angle between the valid tokens' mean m and span(basis) (orthonormal columns,
    zero-padded): ||m - B B^T m|| / ||B^T m|| (a ||B^T m|| of 0 is read as the smallest normal
    float, so m orthogonal to the span gives a finite, huge tangent)."""
    def tan(X, valid):
        w = valid.astype(X.dtype)
        m = jnp.sum(X * w[:, None], axis=0) / jnp.maximum(jnp.sum(w), 1.0)
        c = m @ basis
        perp = scaled_norm(m - basis @ c, small=False)         # the plain norms unless a square overflows
        return perp / jnp.maximum(scaled_norm(c, small=False), jnp.finfo(X.dtype).tiny)
    return tan


def mean_tangent(basis: Float[ArrayLike, "d k"]) -> Observer:
    """tan of the angle between the valid tokens' mean and span(basis), for every state x_0 .. x_T:
    "float[T+1]" (0 when the mean lies in the span; ``basis`` orthonormal, zero-padded columns)."""
    return per_state(_mean_tangent(basis))


def plane_angle(basis: Float[ArrayLike, "d k"]) -> Observer:
    """Each token's angle atan2(x . b_1, x . b_0) in the plane of the first two columns of
    ``basis``, for every state x_0 .. x_T: "float[T+1 n]" (k >= 2)."""
    return per_state(lambda X, valid: jnp.arctan2(X @ basis[:, 1], X @ basis[:, 0]))


# ------------------------------------------------------------------------ the measured run

def run_observers(subspaces: Subspaces, *, planes: Bool[ArrayLike, "U"] | None = None, save_states: bool = False,
                  extras: Optional[Dict[str, Observer]] = None) -> Dict[str, Observer]:
    """The observers of one measured run, for :func:`~powerlens._src.dynamics.run`'s ``observers``:

        alignment  :func:`alignment` (subspaces, planes=planes)  -> :class:`Alignment` "float[T m]"
        consensus  :func:`consensus`                              -> Consensus "float[T+1]"
        finite     :func:`finite`                                 -> "bool[T+1]"
        final      :func:`final`                                  -> "float[n d]"
        states     :func:`states`, when ``save_states``           -> "float[T+1 n d]"

    then ``extras`` (name -> Observer, e.g. ``{"direction_tan": mean_tangent(basis)}``), in that
    order. ``planes``: :func:`rotation_planes` of ``subspaces`` and the layers run, when computed
    already. An extra named like one of the bundle's observers is a ValueError."""
    extras = dict(extras or {})
    for name in extras:
        if name in BUNDLE:
            raise ValueError(f"run_observers: extra observer {name!r} is a name of the bundle {BUNDLE}")
    observers = {"alignment": alignment(subspaces, planes=planes), "consensus": consensus(), "finite": finite(),
                 "final": final()}
    if save_states:
        observers["states"] = states()
    return {**observers, **extras}


BUNDLE = ("alignment", "consensus", "finite", "final", "states")
"""The names of :func:`run_observers`' own observers (states only with ``save_states``)."""


# ------------------------------------------------------------------------ attention weights

def attention_input(lp, X: Float[ArrayLike, "n d"], rule: str) -> Float[ArrayLike, "n d"]:
    """What the attention of one layer reads under ``rule`` (as
    :func:`~powerlens._src.dynamics.layer.layer_step` applies it): the layer's first norm of X for
    ``pre_ln`` and for ``full`` on a pre-norm model, X itself otherwise."""
    pre = rule == "pre_ln" or (rule == "full" and lp.config.norm_placement != "post")
    return norm_of(lp, X, "norm") if pre else X


def head_weights(lp, X: Real[ArrayLike, "n d"], valid: Bool[ArrayLike, "n"], *, attention: str = "softmax",
                 positions: Int[ArrayLike, "n"] | None = None) -> Float[Array, "H n n"]:
    """The attention weights A_h "float[H n n]" of one layer on its input X (rows sum to 1).

    Softmax: A_h = softmax(cap(scale q_h k_h^T) + mask) with the layer's q/k biases, q/k norms,
    RoPE, soft-cap, causal, window and padding masks, query head h reading key head h // r (as
    :func:`~powerlens._src.dynamics.attention.dense_softmax_mix` mixes them); a query with no
    allowed key (padding) gets uniform weights. ``uniform`` and ``identity``: the one
    head-independent pattern, repeated for every head."""
    cfg = lp.config
    n = X.shape[0]
    if attention != "softmax":
        A = uniform_weights(n, valid, cfg.causal, X.dtype) if attention == "uniform" else jnp.eye(n, dtype=X.dtype)
        return jnp.broadcast_to(A, (cfg.n_heads, n, n))
    q, k, _ = softmax_qkv(lp, X, positions)                          # (H, n, e), (G, n, e)
    if cfg.kv_group > 1:
        k = jnp.repeat(k, cfg.kv_group, axis=0)
    s = jnp.einsum("hme,hje->hmj", q, k)
    cap = cfg.attn_softcap
    s = s * jnp.asarray(lp.scale, s.dtype) if cap is None else cap * jnp.tanh(lp.scale * s / cap)
    s = s + key_bias(n, valid, causal=cfg.causal, window=lp.window, dtype=s.dtype)
    return jax.nn.softmax(s, axis=-1)


def attention_maps(layers, *, rule: str, attention: str = "softmax",
                   positions: Int[ArrayLike, "n"] | None = None) -> Observer:
    """The attention weights of every step, per head: "float[T H n n]" (step t: the layer
    schedule[t] reading x_t under ``rule``; :func:`head_weights`).

    ``layers``: the Layers the run iterates (each step reads its layer's q/k weights). Memory is
    O(T H n^2): ask for it when the patterns themselves are wanted."""
    check_rule(rule)
    check_attention(attention)

    def weights(X, u, valid):
        lp = layers.layer(u)
        return head_weights(lp, attention_input(lp, X, rule), valid, attention=attention, positions=positions)

    return Observer(init=lambda x0, valid, layers_: None,
                    update=lambda state, X, Y, step: (state, weights(X, step.layer, step.valid)),
                    of_states=lambda S, valid, layers_, schedule: jax.vmap(weights, (0, 0, None))(
                        S[:-1], schedule, valid))


READY = {"alignment": alignment, "consensus": consensus, "states": states, "finite": finite, "final": final}
