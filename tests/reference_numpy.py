"""A plain NumPy reference of one prompt's token dynamics and its measures.

The test oracle of ``powerlens._src.dynamics`` (it lives under ``tests/``, not in the library).
Written independently of the JAX path (explicit loops over heads, queries and keys,
clarity first); :func:`simulate_fast` is the same maths vectorised within a step, itself
checked against the loops. It imports nothing from powerlens. Everything is float64
unless the inputs ask otherwise.

One unique layer is a dict of NumPy arrays (see :func:`layer_dicts`)::

    W_q (H, e, d)  W_k (G, e, d)  W_v (G, e, d)  W_o (d, H e)
    b_q (H, e)  b_k (G, e)  b_v (G, e)  b_o (d,)   optional
    norm_scale, norm_bias (d,)                    optional (post_ln / pre_ln)
    scale ()  window ()  (0 = global)

and the static facts are plain keyword arguments (``causal``, ``norm``, ``norm_eps``,
``rope_theta``, ``rope_dim``). Query head h reads key/value head h // (H // G).

Maths (column vectors, token i is row i of X (n, d)):

    q_hi = W_qh x_i + b_qh,  k_gj = W_kg x_j + b_kg   (RoPE rotates pairs (a, a + r/2))
    A_h[i, j] = exp(s_hij) / sum_{j' allowed} exp(s_hij'),  s_hij = scale q_hi . k_g(h)j
    allowed(i, j) = valid_j and [causal: j <= i and (window = 0 or j > i - window)]
                                [else:   window = 0 or |i - j| < window]
    attn(X)_i = sum_h W_o[:, h] sum_j A_h[i, j] (W_vg(h) x_j)   (+ W_o b_v + b_o if keep_bias)
    paper:   x_i <- (x_i + attn_i) / ||x_i + attn_i||
    post_ln: x_i <- LN(x_i + attn_i)
    pre_ln:  x_i <- x_i + attn(LN(X))_i
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import numpy as np

_LAYER_FIELDS = ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "b_v", "b_o", "norm_scale", "norm_bias",
                 "scale", "window")


def layer_dicts(layers, dtype=np.float64) -> List[Dict[str, np.ndarray]]:
    """Convert a :class:`~powerlens._src.dynamics.params.Layers` into one dict per unique layer."""
    out = []
    for u in range(layers.n_unique):
        p = {}
        for name in _LAYER_FIELDS:
            a = getattr(layers, name)
            if a is None:
                continue
            a = np.asarray(a)[u]
            p[name] = a.astype(dtype) if name != "window" else int(a)
        out.append(p)
    return out


def static_kwargs(config) -> dict:
    """The static facts the reference needs, read off a LayerConfig."""
    return dict(causal=config.causal, norm=config.norm, norm_eps=config.norm_eps,
                rope_theta=config.rope_theta, rope_dim=config.rope_dim)


# ----------------------------------------------------------------------------- norms

def norm_rows(X, kind: str, scale=None, bias=None, eps: float = 1e-5):
    """Row-wise norm of X (n, d)."""
    Y = np.empty_like(X)
    for i, x in enumerate(X):
        if kind == "l2":
            y = x / math.sqrt(float(np.sum(x * x)))
        elif kind == "layernorm":
            m = float(np.sum(x)) / x.size
            v = float(np.sum((x - m) ** 2)) / x.size
            y = (x - m) / math.sqrt(v + eps)
            if scale is not None:
                y = y * scale
            if bias is not None:
                y = y + bias
        elif kind == "rmsnorm":
            y = x / math.sqrt(float(np.sum(x * x)) / x.size + eps)
            if scale is not None:
                y = y * scale
        else:
            raise ValueError(f"unknown norm {kind!r}")
        Y[i] = y
    return Y


# ------------------------------------------------------------------------- attention

def allowed(n: int, valid, *, causal: bool, window: int = 0) -> np.ndarray:
    """(n, n) bool: may query i read key j."""
    ok = np.zeros((n, n), bool)
    for i in range(n):
        for j in range(n):
            if not valid[j]:
                continue
            if causal:
                ok[i, j] = j <= i and (window <= 0 or j > i - window)
            else:
                ok[i, j] = window <= 0 or abs(i - j) < window
    return ok


def rope(x, positions, theta: float, rope_dim: Optional[int] = None):
    """Rotary embedding of x (n, e): the pair (a, a + r/2) of token i turns by p_i theta^(-2a/r)."""
    n, e = x.shape
    r = e if rope_dim is None else int(rope_dim)
    half = r // 2
    y = x.copy()
    for i in range(n):
        for a in range(half):
            ang = positions[i] * theta ** (-2.0 * a / r)
            c, s = math.cos(ang), math.sin(ang)
            u, w = x[i, a], x[i, a + half]
            y[i, a] = u * c - w * s
            y[i, a + half] = w * c + u * s
    return y


def attention_matrices(p, X, valid, *, mode: str, causal: bool = False, rope_theta=None, rope_dim=None,
                       positions=None) -> np.ndarray:
    """A (H, n, n): one row-stochastic matrix per query head (the same for every head
    in the ``uniform`` and ``identity`` modes)."""
    n = X.shape[0]
    H = p["W_o"].shape[1] // p["W_v"].shape[1]
    window = int(p.get("window", 0))
    if mode == "identity":
        return np.stack([np.eye(n)] * H)
    if mode == "uniform":
        ok = allowed(n, valid, causal=causal)
        A = np.zeros((n, n))
        for i in range(n):
            cnt = ok[i].sum()
            if cnt:
                A[i, ok[i]] = 1.0 / cnt
        return np.stack([A] * H)
    if mode != "softmax":
        raise ValueError(f"unknown attention mode {mode!r}")
    G = p["W_k"].shape[0]
    group = H // G
    if positions is None:
        positions = np.arange(n)
    ok = allowed(n, valid, causal=causal, window=window)
    out = np.zeros((H, n, n))
    for h in range(H):
        g = h // group
        q = X @ p["W_q"][h].T
        k = X @ p["W_k"][g].T
        if "b_q" in p:
            q = q + p["b_q"][h]
        if "b_k" in p:
            k = k + p["b_k"][g]
        if rope_theta is not None:
            q = rope(q, positions, rope_theta, rope_dim)
            k = rope(k, positions, rope_theta, rope_dim)
        for i in range(n):
            js = np.flatnonzero(ok[i])
            if js.size == 0:          # a query with no key (only padding): uniform over all
                out[h, i] = 1.0 / n
                continue
            s = np.array([p["scale"] * float(q[i] @ k[j]) for j in js])
            w = np.exp(s - s.max())
            out[h, i, js] = w / w.sum()
    return out


def attention_out(p, X, valid, *, mode: str, keep_bias: bool = False, causal: bool = False,
                  rope_theta=None, rope_dim=None, positions=None) -> np.ndarray:
    """attn(X) (n, d) = sum_h O_h V_g(h) (A_h X) (+ O b_v + b_o)."""
    A = attention_matrices(p, X, valid, mode=mode, causal=causal, rope_theta=rope_theta,
                           rope_dim=rope_dim, positions=positions)
    H, e = A.shape[0], p["W_v"].shape[1]
    G = p["W_v"].shape[0]
    out = np.zeros_like(X)
    for h in range(H):
        g = h // (H // G)
        O_h = p["W_o"][:, h * e:(h + 1) * e]
        F_h = O_h @ p["W_v"][g]                      # (d, d)
        out += (A[h] @ X) @ F_h.T
        if keep_bias and "b_v" in p:
            out += O_h @ p["b_v"][g]
    if keep_bias and "b_o" in p:
        out += p["b_o"]
    return out


def layer_step(p, X, valid, *, rule: str = "paper", attention: str = "softmax", keep_bias=None,
               causal: bool = False, norm: str = "l2", norm_eps: float = 1e-5, rope_theta=None,
               rope_dim=None, positions=None) -> np.ndarray:
    """One layer under ``rule`` ('paper', 'post_ln', 'pre_ln'): (n, d) -> (n, d)."""
    if keep_bias is None:
        keep_bias = rule != "paper"
    kw = dict(mode=attention, keep_bias=keep_bias, causal=causal, rope_theta=rope_theta,
              rope_dim=rope_dim, positions=positions)
    if rule == "paper":
        return norm_rows(X + attention_out(p, X, valid, **kw), "l2")
    ln = lambda Z: norm_rows(Z, norm, p.get("norm_scale"), p.get("norm_bias"), norm_eps)
    if rule == "post_ln":
        return ln(X + attention_out(p, X, valid, **kw))
    if rule == "pre_ln":
        return X + attention_out(p, ln(X), valid, **kw)
    raise ValueError(f"unknown rule {rule!r} (the reference covers paper, post_ln, pre_ln)")


# -------------------------------------------------------------------------- measures

def alignments(X, basis, k: int) -> np.ndarray:
    """gamma_i = ||B_k^T x_i|| / ||x_i|| with B_k the first k columns of basis (d, >=k)."""
    B = basis[:, :k]
    return np.array([np.linalg.norm(B.T @ x) / np.linalg.norm(x) for x in X])


def consensus(X, valid) -> float:
    """mu = ||X - 1 xbar^T||_F / ||X||_F over valid rows."""
    Z = X[np.asarray(valid, bool)]
    xbar = Z.mean(axis=0)
    return float(np.sqrt(np.sum((Z - xbar) ** 2) / np.sum(Z ** 2)))


def rank_collapse(X, valid) -> float:
    """sqrt(||R||_1 ||R||_inf / (||X||_1 ||X||_inf)), R = X - 1 xbar^T, valid rows only;
    ||M||_1 = max column abs sum, ||M||_inf = max row abs sum."""
    Z = X[np.asarray(valid, bool)]
    R = Z - Z.mean(axis=0)
    n1 = lambda M: max(np.abs(M[:, c]).sum() for c in range(M.shape[1]))
    ninf = lambda M: max(np.abs(M[r]).sum() for r in range(M.shape[0]))
    return float(math.sqrt(n1(R) * ninf(R) / (n1(Z) * ninf(Z))))


def pairwise_cosine(X, valid) -> float:
    """Mean of cos(x_i, x_j) over ordered pairs i != j of valid tokens (0 if fewer than 2)."""
    Z = X[np.asarray(valid, bool)]
    n = Z.shape[0]
    if n < 2:
        return 0.0
    tot = 0.0
    for i in range(n):
        for j in range(n):
            if i != j:
                tot += float(Z[i] @ Z[j]) / (np.linalg.norm(Z[i]) * np.linalg.norm(Z[j]))
    return tot / (n * (n - 1))


def plane_angle(X, basis) -> np.ndarray:
    """Angle of each token in the plane of the first two basis columns."""
    return np.array([math.atan2(float(x @ basis[:, 1]), float(x @ basis[:, 0])) for x in X])


def layer_matrix(p) -> np.ndarray:
    """F = sum_h O_h V_g(h) (d, d) of one layer dict."""
    G, e, d = p["W_v"].shape
    H = p["W_o"].shape[1] // e
    F = np.zeros((d, d))
    for h in range(H):
        F += p["W_o"][:, h * e:(h + 1) * e] @ p["W_v"][h // (H // G)]
    return F


def is_pair_plane(p, basis, k: int) -> bool:
    """Is the k-dim subspace basis[:, :k] a complex-pair plane of F (k = 2 and the 2x2
    restriction B^T F B has non-real eigenvalues, |Im| > 1e-5 max|B^T F B|)? Only then is a
    rotation defined."""
    if k != 2:
        return False
    B = basis[:, :2]
    T2 = B.T @ layer_matrix(p) @ B
    # |Im| above 1e-5 of the block's scale: a repeated real eigenvalue is not a pair
    return bool(np.abs(np.linalg.eigvals(T2).imag).max() > 1e-5 * np.abs(T2).max())


def wrap(a):
    """Wrap angles to [-pi, pi)."""
    return (np.asarray(a) + np.pi) % (2 * np.pi) - np.pi


def mean_step(a1, a0) -> float:
    """Mean of the angle steps s = a1 - a0, each taken on the branch within pi of their
    circular mean c = angle(sum_i e^{i s_i}): wrap(c + mean_i wrap(s_i - c))."""
    s = np.asarray(a1) - np.asarray(a0)
    c = np.angle(np.sum(np.exp(1j * s)))
    return float(wrap(c + np.mean(wrap(s - c))))


# ---------------------------------------------------------------- vectorised path

def _allowed_fast(n, valid, causal, window):
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    ok = np.broadcast_to(valid[None, :], (n, n)).copy()
    if causal:
        ok &= (j <= i) & ((window <= 0) | (j > i - window))
    elif window > 0:
        ok &= np.abs(i - j) < window
    return ok


def rope_fast(x, positions, theta: float, rope_dim: Optional[int] = None):
    """:func:`rope` vectorised: x (..., n, e), positions (n,)."""
    e = x.shape[-1]
    r = e if rope_dim is None else int(rope_dim)
    half = r // 2
    ang = np.asarray(positions, np.float64)[:, None] * theta ** (-2.0 * np.arange(half) / r)   # (n, half)
    c, s = np.cos(ang).astype(x.dtype), np.sin(ang).astype(x.dtype)
    u, w = x[..., :half], x[..., half:2 * half]
    y = x.copy()
    y[..., :half] = u * c - w * s
    y[..., half:2 * half] = w * c + u * s
    return y


def attention_out_fast(p, X, valid, *, mode: str, keep_bias: bool = False, causal: bool = False,
                       rope_theta=None, rope_dim=None, positions=None) -> np.ndarray:
    """Same maths as :func:`attention_out`, vectorised over heads and tokens with NumPy."""
    n = X.shape[0]
    G, e, _ = p["W_v"].shape
    H = p["W_o"].shape[1] // e
    V = np.repeat(np.einsum("ged,nd->gne", p["W_v"], X), H // G, axis=0)        # (H, n, e)
    if mode == "softmax":
        q = np.einsum("hed,nd->hne", p["W_q"], X)
        k = np.repeat(np.einsum("ged,nd->gne", p["W_k"], X), H // G, axis=0)
        if "b_q" in p:
            q = q + p["b_q"][:, None, :]
        if "b_k" in p:
            k = k + np.repeat(p["b_k"], H // G, axis=0)[:, None, :]
        if rope_theta is not None:
            pos = np.arange(n) if positions is None else positions
            q = rope_fast(q, pos, rope_theta, rope_dim)
            k = rope_fast(k, pos, rope_theta, rope_dim)
        s = p["scale"] * np.einsum("hie,hje->hij", q, k)
        ok = _allowed_fast(n, valid, causal, int(p.get("window", 0)))
        s = np.where(ok[None], s, -np.inf)
        mx = s.max(-1, keepdims=True)
        w = np.where(ok[None], np.exp(s - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
        tot = w.sum(-1, keepdims=True)
        A = np.where(tot > 0, w / np.where(tot > 0, tot, 1.0), 1.0 / n)
        M = np.einsum("hij,hje->ihe", A, V)
    elif mode == "uniform":
        ok = _allowed_fast(n, valid, causal, 0).astype(X.dtype)
        A = ok / np.maximum(ok.sum(-1, keepdims=True), 1)
        M = np.einsum("ij,hje->ihe", A, V)
    elif mode == "identity":
        M = V.transpose(1, 0, 2)
    else:
        raise ValueError(f"unknown attention mode {mode!r}")
    out = M.reshape(n, H * e) @ p["W_o"].T
    if keep_bias and "b_v" in p:
        out = out + p["W_o"] @ np.repeat(p["b_v"], H // G, axis=0).reshape(-1)
    if keep_bias and "b_o" in p:
        out = out + p["b_o"]
    return out


def _measures_fast(X, valid, basis, dims):
    """Vectorised gamma per reference (m, n_valid) and the three state measures."""
    Z = X[valid]
    nz = np.linalg.norm(Z, axis=1)
    g = np.linalg.norm(np.einsum("nd,mdk->mnk", Z, basis), axis=-1) / nz       # zero-padded columns
    R_ = Z - Z.mean(0)
    mu = np.sqrt((R_ ** 2).sum() / (Z ** 2).sum())
    n1 = lambda M: np.abs(M).sum(0).max() * np.abs(M).sum(1).max()
    rc = np.sqrt(n1(R_) / n1(Z))
    U_ = Z / nz[:, None]
    s = U_.sum(0)
    n = Z.shape[0]
    pc = (s @ s - n) / (n * (n - 1)) if n > 1 else 0.0
    return g, (mu, rc, pc)


def simulate_fast(params, schedule, x0, basis, dims, *, valid=None, rule: str = "paper",
                  attention: str = "softmax", keep_bias=None, causal: bool = False, norm: str = "l2",
                  norm_eps: float = 1e-5, rope_theta=None, rope_dim=None, save_states: bool = False,
                  dtype=np.float64) -> dict:
    """:func:`simulate` with NumPy-vectorised steps (a Python loop over steps only).

    Only ``rule='paper'``; same outputs as :func:`simulate` (RoPE included).
    """
    if rule != "paper":
        raise ValueError("simulate_fast implements rule 'paper' only")
    if keep_bias is None:
        keep_bias = False
    X = np.array(x0, dtype=dtype)
    n = X.shape[0]
    valid = np.ones(n, bool) if valid is None else np.asarray(valid, bool)
    basis, dims = np.asarray(basis, dtype), np.asarray(dims)
    T, m = len(schedule), dims.shape[1]
    gam, gb, rho, marg = (np.full((T, m), np.nan) for _ in range(4))
    rot = np.full(T, np.nan)
    meas = [None] * (T + 1)
    g0, meas[0] = _measures_fast(X, valid, basis[schedule[0]], dims[schedule[0]])
    states = [X]
    pair = [is_pair_plane(p, basis[u, 0], int(dims[u, 0])) for u, p in enumerate(params)]
    for t, u in enumerate(schedule):
        p = params[u]
        Y = X + attention_out_fast(p, X, valid, mode=attention, keep_bias=keep_bias, causal=causal,
                                   rope_theta=rope_theta, rope_dim=rope_dim)
        Y = Y / np.linalg.norm(Y, axis=1, keepdims=True)
        g0, _ = _measures_fast(X, valid, basis[u], dims[u]) if t else (g0, None)
        g1, meas[t + 1] = _measures_fast(Y, valid, basis[u], dims[u])
        ok = dims[u] > 0
        gam[t, ok] = g1.mean(1)[ok]
        gb[t, ok] = g0.mean(1)[ok]
        rho[t, ok] = (g1 > g0).mean(1)[ok]
        marg[t, ok] = np.abs(g1 - g0).min(1)[ok]
        if pair[u]:
            b = basis[u, 0]
            a1 = np.arctan2(Y[valid] @ b[:, 1], Y[valid] @ b[:, 0])
            a0 = np.arctan2(X[valid] @ b[:, 1], X[valid] @ b[:, 0])
            rot[t] = mean_step(a1, a0)
        if save_states:
            states.append(Y)
        X = Y
    meas = np.array(meas, dtype=np.float64)
    res = dict(gamma=gam, gamma_before=gb, rho=rho, rho_margin=marg, rotation=rot, consensus=meas[:, 0],
               rank_collapse=meas[:, 1], pairwise_cos=meas[:, 2], n_valid=int(valid.sum()), final=X)
    if save_states:
        res["states"] = np.stack(states)
    return res


# -------------------------------------------------------------------------- simulate

def simulate(params: Sequence[dict], schedule: Sequence[int], x0, basis, dims, *, valid=None,
             rule: str = "paper", attention: str = "softmax", keep_bias=None, causal: bool = False,
             norm: str = "l2", norm_eps: float = 1e-5, rope_theta=None, rope_dim=None,
             save_states: bool = False) -> dict:
    """Run the schedule from x0 (n, d) and measure as ``powerlens._src.dynamics.simulate`` does.

    basis (U, m, d, k) and dims (U, m) are the reference subspaces of every unique layer.
    Returns a dict of arrays: gamma, gamma_before, rho (T, m); rho_margin (T, m), the
    smallest |gamma_i(after) - gamma_i(before)| over valid tokens (rho is a count of
    strict inequalities, so ties within rounding may legitimately differ); rotation (T,);
    consensus, rank_collapse, pairwise_cos (T+1,); n_valid; final; states (T+1, n, d).
    """
    X = np.array(x0, dtype=np.float64)
    n = X.shape[0]
    valid = np.ones(n, bool) if valid is None else np.asarray(valid, bool)
    basis, dims = np.asarray(basis, np.float64), np.asarray(dims)
    T, m = len(schedule), dims.shape[1]
    res = {key: np.full((T, m), np.nan) for key in ("gamma", "gamma_before", "rho", "rho_margin")}
    res["rotation"] = np.full(T, np.nan)
    meas = lambda Z: (consensus(Z, valid), rank_collapse(Z, valid), pairwise_cosine(Z, valid))
    per_state = [meas(X)]
    states = [X]
    kw = dict(rule=rule, attention=attention, keep_bias=keep_bias, causal=causal, norm=norm,
              norm_eps=norm_eps, rope_theta=rope_theta, rope_dim=rope_dim)
    for t, u in enumerate(schedule):
        Y = layer_step(params[u], X, valid, **kw)
        for r in range(m):
            k = int(dims[u, r])
            if k == 0:
                continue
            g0 = alignments(X[valid], basis[u, r], k)
            g1 = alignments(Y[valid], basis[u, r], k)
            res["gamma"][t, r] = g1.mean()
            res["gamma_before"][t, r] = g0.mean()
            res["rho"][t, r] = np.mean(g1 > g0)
            res["rho_margin"][t, r] = np.min(np.abs(g1 - g0))
        if is_pair_plane(params[u], basis[u, 0], int(dims[u, 0])):
            res["rotation"][t] = mean_step(plane_angle(Y[valid], basis[u, 0]), plane_angle(X[valid], basis[u, 0]))
        per_state.append(meas(Y))
        if save_states:
            states.append(Y)
        X = Y
    per_state = np.array(per_state)
    res.update(consensus=per_state[:, 0], rank_collapse=per_state[:, 1], pairwise_cos=per_state[:, 2],
               n_valid=int(valid.sum()), final=X)
    if save_states:
        res["states"] = np.stack(states)
    return res


def simulate_layers(layers, x0, subspaces, *, fast: bool = False, **kw) -> dict:
    """:func:`simulate` (or :func:`simulate_fast` with ``fast=True``) for a :class:`Layers`
    and :class:`Subspaces`, converted to NumPy float64."""
    kw = {**static_kwargs(layers.config), **kw}
    run = simulate_fast if fast else simulate
    return run(layer_dicts(layers), layers.schedule, x0, np.asarray(subspaces.basis, np.float64),
               np.asarray(subspaces.dim), **kw)
