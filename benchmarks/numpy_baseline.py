"""The NumPy baseline of ``benchmarks/simulate.py``: exactly the workload it times, no more.

One shared-weight system (a single unique layer applied at every step), rule ``paper``,
softmax attention without mask, window, padding, biases or RoPE (what ``synthetic_system``
builds), every measure on. Vectorised over heads and tokens within a step; a Python loop
over the steps. Column-vector maths, token i is row i of X (n, d)::

    q_hi = W_qh x_i,  k_hj = W_kh x_j,  A_h = softmax_j(scale q_hi . k_hj)
    x_i <- (x_i + attn_i) / ||x_i + attn_i||,  attn_i = sum_h W_o[:, h] sum_j A_h[i, j] W_vh x_j

    gamma_r(t)   mean_i ||B_r^T x_i(t+1)|| / ||x_i(t+1)||   (B_r zero-padded to k columns)
    rho_r(t)     fraction of tokens with gamma_i(t+1) > gamma_i(t)
    rotation(t)  c + mean_i wrap(s_i - c) (wrapped), s_i = theta_i(t+1) - theta_i(t) in the
                 principal plane and c = arg sum_i e^{i s_i}, when that plane is a complex pair
                 of F (else NaN)
    consensus    ||X - 1 xbar^T||_F / ||X||_F;  rank collapse sqrt(||R||_1 ||R||_inf / (||X||_1 ||X||_inf));
                 pairwise cosine, the mean over i != j of cos(x_i, x_j)

It imports nothing from powerlens: the arrays come in as NumPy arrays.
"""
from __future__ import annotations

import numpy as np


def wrap(a):
    """Angles wrapped to [-pi, pi)."""
    return (a + np.pi) % (2 * np.pi) - np.pi


def layer_arrays(layers, dtype=np.float32) -> dict:
    """W_q, W_k, W_v (H, e, d), W_o (d, H e) and scale of the (only) unique layer of ``layers``."""
    p = {name: np.asarray(getattr(layers, name))[0].astype(dtype) for name in ("W_q", "W_k", "W_v", "W_o")}
    p["scale"] = np.asarray(layers.scale)[0].astype(dtype)
    return p


def is_pair_plane(F, B, dim) -> bool:
    """Is the principal reference (d, 2) a complex-pair plane of F: dim 2 and B^T F B with
    |Im lambda| above 1e-5 of the block's scale."""
    if dim != 2:
        return False
    T2 = B[:, :2].T @ F @ B[:, :2]
    return bool(np.abs(np.linalg.eigvals(T2).imag).max() > 1e-5 * np.abs(T2).max())


def _measures(X, basis):
    """gamma (m, n) against every reference basis (m, d, k), the angle in the principal plane
    (n,), and consensus, rank collapse, pairwise cosine."""
    P = np.einsum("nd,mdk->mnk", X, basis)
    nx = np.linalg.norm(X, axis=1)
    g = np.linalg.norm(P, axis=-1) / nx
    angle = np.arctan2(P[0, :, 1], P[0, :, 0])
    R = X - X.mean(0)
    mu = np.sqrt((R ** 2).sum() / (X ** 2).sum())
    n1 = lambda M: np.abs(M).sum(0).max() * np.abs(M).sum(1).max()
    rc = np.sqrt(n1(R) / n1(X))
    s = (X / nx[:, None]).sum(0)
    n = X.shape[0]
    pc = (s @ s - n) / (n * (n - 1)) if n > 1 else 0.0
    return g, angle, (mu, rc, pc)


def step(p, X):
    """One paper-rule softmax step (n, d) -> (n, d)."""
    n = X.shape[0]
    H, e, _ = p["W_v"].shape
    q = np.einsum("hed,nd->hne", p["W_q"], X)
    k = np.einsum("hed,nd->hne", p["W_k"], X)
    v = np.einsum("hed,nd->hne", p["W_v"], X)
    s = p["scale"] * np.einsum("hie,hje->hij", q, k)
    w = np.exp(s - s.max(-1, keepdims=True))
    A = w / w.sum(-1, keepdims=True)
    M = np.einsum("hij,hje->ihe", A, v).reshape(n, H * e)
    Y = X + M @ p["W_o"].T
    return Y / np.linalg.norm(Y, axis=1, keepdims=True)


def simulate(p, x0, basis, dims, steps: int, dtype=np.float32) -> dict:
    """``steps`` paper-rule softmax steps of one shared layer from x0 (n, d), measured.

    basis (m, d, k) and dims (m,) are the layer's reference subspaces (a 0 dim: undefined).
    Returns gamma, gamma_before, rho (T, m); rotation (T,); consensus, rank_collapse,
    pairwise_cos (T + 1,); final (n, d).
    """
    X = np.array(x0, dtype=dtype)
    basis, dims = np.asarray(basis, dtype), np.asarray(dims)
    T, m = int(steps), dims.shape[0]
    gam, gb, rho = (np.full((T, m), np.nan) for _ in range(3))
    rot = np.full(T, np.nan)
    meas = np.empty((T + 1, 3))
    F = sum(p["W_o"][:, h * p["W_v"].shape[1]:(h + 1) * p["W_v"].shape[1]] @ p["W_v"][h]
            for h in range(p["W_v"].shape[0]))
    pair = is_pair_plane(F.astype(np.float64), basis[0].astype(np.float64), int(dims[0]))
    ok = dims > 0
    g0, a0, meas[0] = _measures(X, basis)
    for t in range(T):
        Y = step(p, X)
        g1, a1, meas[t + 1] = _measures(Y, basis)     # "before" of step t + 1 is "after" of t
        gam[t, ok] = g1.mean(1)[ok]
        gb[t, ok] = g0.mean(1)[ok]
        rho[t, ok] = (g1 > g0).mean(1)[ok]
        if pair:
            s = a1 - a0
            c = np.angle(np.sum(np.exp(1j * s)))
            rot[t] = wrap(c + wrap(s - c).mean())
        X, g0, a0 = Y, g1, a1
    return dict(gamma=gam, gamma_before=gb, rho=rho, rotation=rot, consensus=meas[:, 0],
                rank_collapse=meas[:, 1], pairwise_cos=meas[:, 2], final=X)
