"""``run``: the one ``lax.scan`` over a layer schedule, with observers.

For one prompt x0 "float[n d]" and its mask valid "bool[n]", step t = 0 .. T-1 applies unique
layer u = schedule[t] under ``rule``::

    x_{t+1} = layer_step(layers.layer(u), x_t)          (design.md §1)

and hands (x_t, x_{t+1}) to every observer (:mod:`powerlens._src.dynamics.observers`). Written
for one prompt and one system: batch prompts, or sweep systems, with ``vmap``.

Costs paid once, outside the scan: the (in, out) copies of every unique layer's attention
weights, the fused q/k/v weight and W_o
(:class:`~powerlens._src.dynamics.projections.Projections`; built once per set of weights, outside
the compiled program, by the jitted entry points; weights traced by a caller's jit or grad
are read in place, one layer's rows a step, except a single unique layer's, whose copies are
built once before the scan), and, for a single unique layer (a shared-weight system), that
layer's parameters (no gather per step). A compact static schedule
(:class:`~powerlens._src.dynamics.schedule.Schedule`: a shared-weight system, or one step per
layer) is scanned by its length alone: no "int[T]" index array is built.

Padding is inert: the padding rows of every state, x_0 included, hold the unit vector e_1
(one elementwise ``where`` per step, no second pass over the layer). Whatever a padding token was
given (a zero embedding row, say) or would become (a zero row under N2, a query with no key
to attend to), it stays finite, so no NaN can leak through a mask into the valid tokens
(A_ij = 0 times NaN is NaN); valid tokens never read a padding key, so their states are the
same as without it.

Dtypes: the weights keep their stored dtype; each step casts its layer's weights to
``layers.dtype`` (``config.compute_dtype``, :func:`~powerlens._src.dynamics.params.cast_layer`),
so at most one layer is upcast at a time, and the tokens are held in that dtype. Every
matmul of the scan runs at ``config.precision`` (default ``"highest"``: full float32 on a
GPU too, never TF32).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import execution
from .inputs import check_batch, check_mask, check_schedule, check_tokens, concrete
from .layer import layer_step
from .observers import READY, Observer, Step, states
from .options import Dynamics, as_dynamics
from .params import Layers, cast_layer, real_array
from .projections import Projections, build_projections, prepared_projections
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Real


def run(layers: Layers, x0: Real[ArrayLike, "n d"], valid: Bool[ArrayLike, "n"] | Int[ArrayLike, "n"] | None, *,
        observers: Mapping[str, Observer], dynamics: Optional[Dynamics] = None,
        positions: Int[ArrayLike, "n"] | None = None, schedule: Int[ArrayLike, "T"] | None = None,
        projections: Optional[Projections] = None, measure_after: bool = False,
        rule: Optional[str] = None, attention: Optional[str] = None,
        keep_bias: Optional[bool] = None) -> Dict[str, Any]:
    """Iterate ``layers`` from x0 and return ``{name: result}`` of every observer.

    Args:
      layers: stacked :class:`~powerlens._src.dynamics.params.Layers` (U unique layers).
      x0: the initial tokens "float[n d]".
      valid: "bool[n]", False for padding tokens (masked out of attention keys and of
        every measure); ``None`` = all valid.
      observers: name -> :class:`~powerlens._src.dynamics.observers.Observer`, e.g.
        ``{"final": final(), "gamma": alignment(subspaces)}``.
      dynamics: the rule, attention mode and bias of every step, and how softmax attention is
        computed (``attention_block``), a :class:`~powerlens._src.dynamics.options.Dynamics`
        (default ``Dynamics()``: the paper's rule, softmax attention; ``faithful`` is resolved
        against ``layers.config``).
      rule, attention, keep_bias: deprecated, ``dynamics``' fields as loose keywords.
      positions: token positions "int[n]" for RoPE (default 0 .. n-1).
      schedule: the unique layer of each step "int[T]" (default ``layers.schedule``).
      projections: the (in, out) copies of every unique layer's attention weights
        (:class:`~powerlens._src.dynamics.projections.Projections` of ``layers``): the jitted entry
        points pass :func:`~powerlens._src.dynamics.projections.prepared_projections`' copy. When
        None (weights traced by the caller's jit or grad), each step reads its layer's rows in
        place, X @ W^T: no copy of every layer is built inside the program. A single unique
        layer (a shared-weight system, e.g. each system of a sweep) is the exception: its
        copies are built once before the scan, which all T steps then read
        (benchmarks/vs_torch.py's sweep D, 256 systems of 200 steps: 0.91-0.92 of the time,
        the same states).
      measure_after: keep every state "float[T+1 n d]" in the scan and measure them all at once
        afterwards (each observer's ``of_states``), instead of step by step. The same numbers;
        faster when the states are small (fewer, larger kernels), slower and O(T n d) memory
        when they are not: :func:`measure_after_pays` picks it. Ignored unless every observer
        has ``of_states``.

    Returns:
      A dict with one entry per observer: what its ``finish`` returns.

    Raises ValueError for a complex or wrongly shaped x0 or mask, and, where they are concrete
    (not traced by a caller's ``jit``, ``vmap`` or ``grad``), for a mask with no valid token, a
    schedule index outside [0, U) and a valid token that is non-finite or zero
    (:mod:`powerlens._src.dynamics.inputs`).
    """
    dyn = as_dynamics(dynamics, rule, attention, keep_bias, where="run").resolved(layers.config)
    with jax.default_matmul_precision(layers.config.precision):
        return _run(layers, x0, valid, rule=dyn.rule, attention=dyn.attention, observers=observers,
                    keep_bias=dyn.keep_bias, attention_block=dyn.attention_block,
                    positions=positions, schedule=schedule, projections=projections, measure_after=measure_after)


def _run(layers, x0, valid, *, rule, attention, observers, keep_bias, positions, schedule, projections,
         measure_after, attention_block=None):
    """:func:`run`'s body, traced under the layers' matmul precision."""
    x0, valid, schedule = _checked(layers, x0, valid, schedule)
    dtype = layers.dtype
    upcast = dtype != layers.storage_dtype
    cast = (lambda lp: cast_layer(lp, dtype)) if upcast else (lambda lp: lp)
    x0 = jnp.asarray(x0, dtype)          # the system's precision (NumPy float64 tokens too)
    if valid is None:
        valid = jnp.ones(x0.shape[:1], bool)
        inert = lambda X: X                          # no padding
    else:
        inert = lambda X: inert_padding(X, valid)
    x0 = inert(x0)
    static = layers.schedule if schedule is None else None
    if static is not None and static.arithmetic:      # layer of step t = start + stride * t
        xs, length, layer_of = None, len(static), lambda t, _: static.start + static.stride * t
    else:
        xs = jnp.asarray(static if schedule is None else schedule, jnp.int32)
        length, layer_of = xs.shape[0], lambda t, u: u
    shared = layers.n_unique == 1          # hoist the one layer's parameters out of the scan
    lp0 = cast(layers.layer(0)) if shared else None
    proj0 = None
    if shared:    # the one layer's (in, out) copies: given, or built once here (traced weights too)
        proj0 = projections.layer(0) if projections is not None else build_projections(lp0, attention)
    observers = dict(observers)

    # Weights cast per step travel in the scan's carry behind an optimization barrier: XLA's CPU
    # compiler otherwise hoists the cast of the loop-invariant stack out of the loop, a float32
    # copy of every layer at once, instead of the one layer each step reads
    carried = upcast and not shared

    def step(carry, u):
        X, obs_states, t, held = carry
        if carried:
            X, held = jax.lax.optimization_barrier((X, held))
        u = layer_of(t, u)
        lp = lp0 if shared else cast((held if carried else layers).layer(u))   # this layer alone, computed in dtype
        proj = proj0 if shared else (None if projections is None else projections.layer(u))
        Y = inert(layer_step(lp, X, valid, rule=rule, attention=attention, keep_bias=keep_bias,
                             positions=positions, projections=proj, attention_block=attention_block))
        info = Step(t=t, layer=u, valid=valid)
        new, outs = {}, {}
        for name, ob in observers.items():
            new[name], outs[name] = ob.update(obs_states[name], X, Y, info)
        return (Y, new, t + 1, held), outs

    after = measure_after and all(ob.of_states is not None for ob in observers.values())
    if after:                                    # the scan keeps the states; measured below
        measured, observers = observers, {"states": states()}
    init = {name: ob.init(x0, valid, layers) for name, ob in observers.items()}
    (_, last, _, _), outs = jax.lax.scan(step, (x0, init, jnp.zeros((), jnp.int32), layers if carried else None),
                                         xs, length=length)
    out = {name: ob.finish(last[name], outs[name]) for name, ob in observers.items()}
    if not after:
        return out
    layer_of_step = xs if xs is not None else jnp.arange(length, dtype=jnp.int32) * static.stride + static.start
    return {name: ob.of_states(out["states"], valid, layers, layer_of_step) for name, ob in measured.items()}


def inert_padding(X: Float[ArrayLike, "*batch n d"],
                  valid: Bool[ArrayLike, "*batch n"] | Int[ArrayLike, "*batch n"]) -> Float[Array, "*batch n d"]:
    """X with each padding token replaced by the unit row e_0: finite and non-zero, so that a
    norm of it stays finite (attention gives it no weight, and NaN times zero weight is NaN)."""
    return jnp.where(valid[..., None], X, jnp.zeros(X.shape[-1], X.dtype).at[0].set(1))


def _checked(layers: Layers, x0, valid, schedule):
    """``run``'s inputs validated: x0 real "float[n d]" and valid "bool[n]" always (dtype and
    shape are known when traced too); the values (a valid token, a schedule in range, the
    tokens finite and non-zero) where they are concrete. Returns (x0, valid, schedule)."""
    d = layers.config.d_model
    x0 = real_array("x0", x0)                      # complex is refused, never cast (traced x0 too)
    if x0.ndim != 2 or x0.shape[-1] != d or x0.shape[0] == 0:
        raise ValueError(f"run takes one prompt x0 of shape (n, {d}) with n >= 1, got {tuple(x0.shape)}; "
                         f"batch prompts with vmap or run_batch")
    v = None
    if valid is not None:
        if tuple(np.shape(valid)) != x0.shape[:1]:
            raise ValueError(f"valid mask has shape {tuple(np.shape(valid))}, expected {x0.shape[:1]}")
        v = concrete(valid)
        if v is not None:
            v = check_mask(v, x0.shape[:1])
            valid = jnp.asarray(v)
    if schedule is not None:
        s = concrete(schedule)
        if s is not None:
            schedule = check_schedule(s, layers.n_unique)
    xc = concrete(x0)
    if xc is not None and (valid is None or v is not None):
        check_tokens(xc, d, valid=v, dtype=layers.dtype)
    return x0, valid, schedule


def measure_after_pays(layers: Layers, X0: Real[ArrayLike, "B n d"],
                       schedule: Int[ArrayLike, "T"] | None = None) -> bool:
    """Whether ``measure_after`` pays for the prompts X0 run through ``layers`` (over
    ``schedule``, default the layers' own): all their states, (T+1) B n d numbers of the
    layers' dtype, fit in :attr:`~powerlens._src.dynamics.execution.Tuning.measure_after_bytes`."""
    T = len(layers.schedule) if schedule is None else np.shape(schedule)[0]
    B, n, d = np.shape(X0)
    return B * (T + 1) * n * d * np.dtype(layers.dtype).itemsize <= execution.TUNING.measure_after_bytes


def platform_of(array) -> str:
    """The platform ("cpu", "gpu", "tpu") of the device holding ``array``, where a program
    reading it runs; ``jax.default_backend()`` for a host (NumPy) array."""
    devices = getattr(array, "devices", None)
    if callable(devices):
        held = devices()
        if held:
            return next(iter(held)).platform
    return jax.default_backend()


def prompt_chunk(batch: int, tokens: int, platform: Optional[str] = None) -> Optional[int]:
    """Prompts per step of :func:`map_prompts` for ``batch`` prompts of ``tokens`` tokens
    (:attr:`~powerlens._src.dynamics.execution.Tuning.chunk_tokens_cpu`), or None: one ``vmap`` over the whole batch (any platform but
    the CPU, prompts over :attr:`~powerlens._src.dynamics.execution.Tuning.blocked_above` tokens, or a
    batch that is one chunk already). ``platform``: where the program runs (the entry points
    pass :func:`platform_of` their weights); default ``jax.default_backend()``."""
    platform = jax.default_backend() if platform is None else platform
    if platform != "cpu" or tokens > execution.TUNING.blocked_above:
        return None
    chunk = max(1, execution.TUNING.chunk_tokens_cpu // max(tokens, 1))
    return chunk if batch > chunk else None


def map_prompts(one: Callable, X0: Float[ArrayLike, "B n d"], valid: Bool[ArrayLike, "B n"],
                chunk: Optional[int] = None, *, out_axes: Any = 0):
    """``one(x, valid)`` (one prompt -> a pytree) over the prompts: one ``vmap``, or steps of
    ``chunk`` prompts (:func:`prompt_chunk`), each one ``vmap``: ``lax.map`` when every output
    is prompt-first, else a ``lax.scan`` that writes each step's outputs in place into the
    whole batch's arrays (the remainder, when ``chunk`` does not divide B, is one more
    ``vmap`` after the scan).
    ``out_axes``: where each output gets its prompt axis B, as in ``vmap`` (0 or 1; a prefix
    of the output's tree). A chunk's outputs go straight to that axis, so a steps-first
    "float[T+1 B n d]" is never transposed from a prompt-first copy (that copy, a fresh
    buffer the size of all states, cost 5-6 % of MiniLM's 32 x 128 states-only call)."""
    batched = jax.vmap(one, out_axes=out_axes)
    if chunk is None or chunk >= X0.shape[0]:
        return batched(X0, valid)
    if not any(jax.tree_util.tree_leaves(out_axes)):        # all prompt-first: lax.map's own layout
        return jax.lax.map(lambda xv: one(*xv), (X0, valid), batch_size=chunk)
    shapes = jax.eval_shape(batched, X0[:chunk], valid[:chunk])
    # each output leaf's prompt axis (out_axes is a prefix of the output's tree)
    axes = jax.tree_util.tree_map(lambda ax, sub: jax.tree_util.tree_map(lambda _: ax, sub), out_axes, shapes)
    B = X0.shape[0]
    steps, whole = B // chunk, B // chunk * chunk

    def empty(s, ax):
        shape = list(s.shape)
        shape[ax] = B
        return jnp.zeros(shape, s.dtype)

    def put(bufs, part, start):
        return jax.tree_util.tree_map(lambda b, p, ax: jax.lax.dynamic_update_slice_in_dim(b, p, start, ax),
                                      bufs, part, axes)

    def step(bufs, i):
        start = i * chunk
        take = lambda a: jax.lax.dynamic_slice_in_dim(a, start, chunk)
        return put(bufs, batched(take(X0), take(valid)), start), None

    bufs, _ = jax.lax.scan(step, jax.tree_util.tree_map(empty, shapes, axes), jnp.arange(steps))
    if whole < B:
        bufs = put(bufs, batched(X0[whole:], valid[whole:]), whole)
    return bufs


@functools.partial(jax.jit, static_argnames=("dynamics", "observe", "steps_first", "measure_after", "chunk"))
def _run_batch(layers, X0, valid, positions, schedule, projections=None, *, dynamics, observe,
               steps_first=False, measure_after=False, chunk=None):
    one = lambda x, v: run(layers, x, v, dynamics=dynamics,
                           positions=positions, schedule=schedule, projections=projections, measure_after=measure_after,
                           observers={name: READY[name]() for name in observe})
    # the scan stacks each prompt's states step-major: with the prompt axis put second,
    # "float[T+1 B n d]" comes out of one vmap without the transpose that axis 0 then swapaxes would cost
    out_axes = {name: int(steps_first and name == "states") for name in observe}
    return map_prompts(one, X0, valid, chunk, out_axes=out_axes)


BATCH_OBSERVERS = ("consensus", "states", "finite", "final")


def run_batch(layers: Layers, X0: Real[ArrayLike, "*B n d"],
              valid: Bool[ArrayLike, "*B n"] | Int[ArrayLike, "*B n"] | None = None, *,
              dynamics: Optional[Dynamics] = None, observe: Sequence[str] = ("final",),
              positions: Int[ArrayLike, "n"] | None = None, schedule: Int[ArrayLike, "T"] | None = None,
              steps_first: bool = False, rule: Optional[str] = None, attention: Optional[str] = None,
              keep_bias: Optional[bool] = None) -> Dict[str, Any]:
    """:func:`run` over a batch of prompts (validated, jit-compiled, vmapped; on a CPU, short
    prompts in chunks of :func:`prompt_chunk` prompts), with the ready observers that need no
    arrays, by name: ``consensus``, ``states``, ``finite``, ``final``. ``dynamics``: as for
    :func:`run` (default ``Dynamics()``); ``rule``, ``attention``, ``keep_bias``: deprecated.

    Returns ``{name: result}`` with a leading prompt axis B, e.g. ``"final"``:
    "float[B n d]", ``"states"``: "float[B T+1 n d]" ("float[T+1 B n d]" with ``steps_first``,
    the order the scan writes them in). A single prompt "float[n d]" gets B = 1.

    Validated on the host first (:func:`~powerlens._src.dynamics.inputs.check_batch`, and
    :func:`~powerlens._src.dynamics.inputs.check_schedule` for a ``schedule`` array): one-line
    ValueErrors, never a cast or a clamp.
    """
    dyn = as_dynamics(dynamics, rule, attention, keep_bias, where="run_batch").resolved(layers.config)
    bad = [o for o in observe if o not in BATCH_OBSERVERS]
    if bad:
        raise ValueError(f"unknown observer(s) {bad} for run_batch; expected some of {BATCH_OBSERVERS}")
    given = X0
    X0, valid = check_batch(X0, valid, layers.config.d_model, dtype=layers.dtype)
    if schedule is not None:
        schedule = check_schedule(schedule, layers.n_unique)
    # prompts placed over devices (pl.shard_prompts: B over a mesh's data axis) stay where they
    # are, so that the compiled call splits the batch as they are split; others go as host arrays
    placed = isinstance(given, jax.Array) and len(given.sharding.device_set) > 1 and given.shape == X0.shape
    x_in = given.astype(layers.dtype) if placed else np.asarray(X0, layers.dtype)
    # weights held in another dtype than the compute dtype are cast a layer at a time inside the
    # scan: no (in, out) copies of every layer (they would be a second copy of the attention weights)
    same = layers.dtype == layers.storage_dtype
    # states and final alone: nothing to measure after
    after = any(o in ("consensus", "finite") for o in observe) and measure_after_pays(layers, X0, schedule)
    # host arrays go straight into the compiled call (its C++ path transfers them; jnp.asarray
    # would dispatch one more operation each, about 0.4 ms of a 3 ms 1 x 16 MiniLM call)
    return _run_batch(layers, x_in, valid, positions, schedule,
                      prepared_projections(layers, dyn.attention) if same else None, dynamics=dyn,
                      observe=tuple(observe), steps_first=bool(steps_first), measure_after=after,
                      chunk=prompt_chunk(*np.shape(X0)[:2], platform_of(layers.W_v)))
