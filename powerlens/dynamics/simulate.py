"""Run the token dynamics with ``lax.scan`` and measure inside the scan.

``simulate`` is written for one prompt X0 (n, d) and one system; batch prompts and
sweep systems with ``vmap`` (``simulate_batch`` does the former). Step t applies
unique layer ``schedule[t]`` and records, against that layer's reference subspaces
S (see :class:`powerlens.analysis.spectra.Subspaces`):

    gamma[t, r]        mean over valid tokens of gamma_i(X_{t+1}) against reference r
    gamma_before[t, r] the same for X_t (the tokens entering the layer)
    rho[t, r]          fraction of valid tokens with gamma_i(X_{t+1}) > gamma_i(X_t)
    rotation[t]        mean angle step of the tokens in the principal plane (NaN unless
                       the principal subspace is a 2-D complex pair plane)
    consensus, rank_collapse, pairwise_cos   (T+1,) including the initial state

Memory is O(T) scalars unless ``save_states`` keeps the (T+1, n, d) states.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..analysis import measures as M
from .attention import check_attention
from .layer import check_rule, layer_step
from .params import layer_matrices


@struct.dataclass
class Trajectory:
    gamma: jax.Array            # (T, m)
    gamma_before: jax.Array     # (T, m)
    rho: jax.Array              # (T, m)
    rotation: jax.Array         # (T,)
    consensus: jax.Array        # (T+1,)
    rank_collapse: jax.Array    # (T+1,)
    pairwise_cos: jax.Array     # (T+1,)
    n_valid: jax.Array          # ()
    final: jax.Array            # (n, d)
    states: Optional[jax.Array] = None  # (T+1, n, d) when asked


def _state_measures(X, valid, norms=None):
    """consensus mu, rank-collapse residual and mean pairwise cosine of one state, sharing the
    token mean, the masked residual and the row norms (same maths as
    :func:`~powerlens.analysis.measures.consensus_distance`, ``rank_collapse_residual``,
    ``mean_pairwise_cosine``)."""
    w = valid.astype(X.dtype)
    n = jnp.maximum(w.sum(), 1.0)
    Xw = X * w[:, None]
    R = (X - (w @ X) / n) * w[:, None]
    mu = jnp.sqrt(jnp.sum(R * R) / jnp.sum(Xw * Xw))
    aR, aX = jnp.abs(R), jnp.abs(Xw)
    n1inf = lambda A: jnp.max(jnp.sum(A, axis=0)) * jnp.max(jnp.sum(A, axis=1))
    res = jnp.sqrt(n1inf(aR) / n1inf(aX))
    if norms is None:
        norms = jnp.linalg.norm(X, axis=-1)
    s = (w / jnp.where(norms > 0, norms, 1.0)) @ X     # (a zero padding row must not give NaN)
    pc = (jnp.dot(s, s) - jnp.sum(w)) / jnp.maximum(n * (n - 1), 1.0)
    return mu, res, pc


def simulate(layers, x0, subspaces, *, valid=None, rule: str = "paper", attention: str = "softmax",
             keep_bias: Optional[bool] = None, save_states: bool = False, schedule=None,
             positions=None) -> Trajectory:
    """Iterate ``layers`` over its schedule from x0 (n, d). Pure; jit/vmap it.

    Args:
      layers: :class:`~powerlens.dynamics.params.Layers` (its static schedule, or the
        ``schedule`` array given here, picks the unique layer of each step).
      x0: initial tokens (n, d).
      subspaces: reference subspaces, basis (U, m, d, k), dim (U, m).
      valid: (n,) bool, False for padding tokens (excluded from attention keys and
        from every measure).
      rule, attention, keep_bias: see :func:`powerlens.dynamics.layer.layer_step`.
      save_states: also return all states (T+1, n, d).
    """
    check_rule(rule)
    check_attention(attention)
    n = x0.shape[0]
    if valid is None:
        valid = jnp.ones((n,), bool)
    sched = jnp.asarray(layers.schedule if schedule is None else schedule, jnp.int32)
    # rotation is defined only for a complex-pair plane: a 2-D principal subspace on which
    # the restriction T2 = B^T F B has complex eigenvalues (not a repeated real one)
    if subspaces.basis.shape[-1] >= 2:
        B2 = subspaces.basis[:, 0, :, :2]                               # (U, d, 2)
        T2 = jnp.einsum("udi,ude,uej->uij", B2, layer_matrices(layers), B2)
        disc = 0.25 * (T2[:, 0, 0] - T2[:, 1, 1]) ** 2 + T2[:, 0, 1] * T2[:, 1, 0]
        # complex iff disc < 0; a repeated real eigenvalue gives disc ~ 0 up to rounding, so
        # |Im lambda| must exceed 1e-5 of the block's scale
        tol = (1e-5 * jnp.max(jnp.abs(T2), axis=(1, 2))) ** 2
        is_pair = (subspaces.dim[:, 0] == 2) & (disc < -tol)           # (U,)
    else:                                                               # only 1-D references
        is_pair = jnp.zeros(subspaces.dim.shape[:1], bool)

    U, m, d, k = subspaces.basis.shape
    # all m reference bases side by side: one (d, m k) matmul projects the tokens on all of them
    B_all = jnp.swapaxes(subspaces.basis, 1, 2).reshape(U, d, m * k)
    shared = U == 1            # one unique layer: hoist its parameters out of the scan (no gather)

    def project(X, u, norms=None):
        """gamma (m, n) against every reference and each token's angle in the principal plane (n,)."""
        P = (X @ B_all[u]).reshape(n, m, k)
        norms = jnp.linalg.norm(X, axis=-1) if norms is None else norms
        g = (jnp.linalg.norm(P, axis=-1) / jnp.where(norms > 0, norms, 1.0)[:, None]).T
        return g, jnp.arctan2(P[:, 0, 1], P[:, 0, 0]) if k >= 2 else None   # angle in the plane

    # softmax: the fused q/k/v projection weight of every unique layer, built once
    qkv_all = None
    if attention == "softmax" and layers.W_q is not None and layers.W_k is not None:
        qkv_all = jnp.concatenate([a.reshape(U, -1, d) for a in (layers.W_q, layers.W_k, layers.W_v)], axis=1)
    lp0 = layers.layer(0) if shared else None

    def step(carry, u):
        X, prev = carry
        lp = lp0 if shared else layers.layer(u)
        qkv = None if qkv_all is None else qkv_all[0 if shared else u]
        dims = subspaces.dim[u]                   # (m,)
        Y = layer_step(lp, X, valid, rule=rule, attention=attention, keep_bias=keep_bias,
                       positions=positions, qkv=qkv)
        g0, c0 = prev if shared else project(X, u)   # shared: X was projected on the same bases
        nY = jnp.linalg.norm(Y, axis=-1)
        g1, c1 = project(Y, u, nY)
        defined = dims > 0
        gamma = jnp.where(defined, M.masked_mean(g1, valid), jnp.nan)
        gamma_b = jnp.where(defined, M.masked_mean(g0, valid), jnp.nan)
        rho = jnp.where(defined, M.masked_mean((g1 > g0).astype(X.dtype), valid), jnp.nan)
        if k >= 2:
            dtheta = M.wrap_angle(c1 - c0)
            rot = jnp.where(is_pair[u], M.masked_mean(dtheta, valid), jnp.nan)
        else:
            rot = jnp.full((), jnp.nan, X.dtype)
        out = (gamma, gamma_b, rho, rot) + _state_measures(Y, valid, nY)
        if save_states:
            out = out + (Y,)
        return (Y, (g1, c1) if shared else None), out

    init = (x0, project(x0, 0) if shared else None)
    (final, _), outs = jax.lax.scan(step, init, sched)
    c0, r0, p0 = _state_measures(x0, valid)
    cat = lambda a0, a: jnp.concatenate([a0[None], a])
    states = jnp.concatenate([x0[None], outs[7]]) if save_states else None
    return Trajectory(gamma=outs[0], gamma_before=outs[1], rho=outs[2], rotation=outs[3],
                      consensus=cat(c0, outs[4]), rank_collapse=cat(r0, outs[5]),
                      pairwise_cos=cat(p0, outs[6]), n_valid=jnp.sum(valid), final=final, states=states)


_STATIC = ("rule", "attention", "keep_bias", "save_states")
simulate_jit = jax.jit(simulate, static_argnames=_STATIC)


def _simulate_batch(layers, X0, subspaces, valid, positions, schedule, **kw):
    f = lambda x, v: simulate(layers, x, subspaces, valid=v, positions=positions, schedule=schedule, **kw)
    return jax.vmap(f)(X0, valid)


simulate_batch_jit = jax.jit(_simulate_batch, static_argnames=_STATIC)


def check_tokens(x0, d: Optional[int] = None, name: str = "x0") -> np.ndarray:
    """Validate initial tokens (n, d) or (B, n, d): finite, non-zero rows, right width."""
    x = np.asarray(x0)
    if x.ndim not in (2, 3):
        raise ValueError(f"{name} must have shape (n, d) or (B, n, d), got {x.shape}")
    if x.shape[-2] == 0:
        raise ValueError(f"{name} has no tokens (shape {x.shape})")
    if d is not None and x.shape[-1] != d:
        raise ValueError(f"{name} has width {x.shape[-1]} but the system has d={d}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} contains non-finite values (NaN or inf)")
    norms = np.linalg.norm(x, axis=-1)
    if np.any(norms == 0):
        bad = np.argwhere(norms == 0)[0].tolist()
        raise ValueError(f"{name} has a zero-norm token at index {bad}")
    return x


def check_batch(X0, valid, d: int):
    """Validated prompts X0 (B, n, d) (a single (n, d) prompt gets B = 1) and mask valid (B, n)."""
    X0 = check_tokens(X0, d)
    if X0.ndim == 2:
        X0 = X0[None]
    if valid is None:
        valid = np.ones(X0.shape[:2], bool)
    valid = np.asarray(valid, bool)
    if valid.ndim == 1:
        valid = valid[None]
    if valid.shape != X0.shape[:2]:
        raise ValueError(f"valid mask has shape {valid.shape}, expected {X0.shape[:2]}")
    if not valid.any(axis=1).all():
        raise ValueError("a prompt has no valid token (empty prompt)")
    return X0, valid


def simulate_batch(layers, X0, subspaces, *, valid=None, rule: str = "paper", attention: str = "softmax",
                   keep_bias: Optional[bool] = None, save_states: bool = False, schedule=None,
                   positions=None) -> Trajectory:
    """``simulate`` vmapped over a batch of prompts X0 (B, n, d) with ``valid`` (B, n).

    Validates the inputs (clear errors, never a silent NaN) and runs jit-compiled.
    """
    check_rule(rule)
    check_attention(attention)
    X0, valid = check_batch(X0, valid, layers.config.d_model)
    if schedule is not None:
        schedule = jnp.asarray(schedule, jnp.int32)
    dtype = layers.W_v.dtype
    return simulate_batch_jit(layers, jnp.asarray(X0, dtype), subspaces, jnp.asarray(valid), positions,
                              schedule, rule=rule, attention=attention, keep_bias=keep_bias,
                              save_states=save_states)


def pooled(traj: Trajectory) -> dict:
    """Pool a batch Trajectory over prompts, weighting by valid tokens.

    Returns NumPy arrays: gamma, gamma_before, rho (T, m); rho_count, n_tokens; and the
    prompt-mean of consensus, rank_collapse, pairwise_cos (T+1,) and rotation (T,).
    """
    w = np.asarray(traj.n_valid, np.float64)
    if w.ndim == 0:
        traj = jax.tree_util.tree_map(lambda a: a[None], traj)
        w = w[None]
    tot = w.sum()
    wm = lambda a: np.tensordot(w, np.asarray(a, np.float64), axes=(0, 0)) / tot
    rho = wm(traj.rho)
    return {
        "gamma": wm(traj.gamma), "gamma_before": wm(traj.gamma_before), "rho": rho,
        "rho_count": np.rint(np.nan_to_num(rho) * tot).astype(np.int64), "n_tokens": int(tot),
        "consensus": np.asarray(traj.consensus, np.float64).mean(0),
        "rank_collapse": np.asarray(traj.rank_collapse, np.float64).mean(0),
        "pairwise_cos": np.asarray(traj.pairwise_cos, np.float64).mean(0),
        "rotation": np.asarray(traj.rotation, np.float64).mean(0),
    }
