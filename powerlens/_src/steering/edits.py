"""The edits the steering optimisers learn (design.md §4), as parameter pytrees and their sizes.

One edit of unique layer l, with scale n0 (the closed-form start's norm)::

    "lowrank"     W_o[l] += dO = n0 P Q^T          (P (d, r), Q (H e, r)), rank r
    "w_alpha"     W_o[l] += dO = e^a u w^T         (a scalar, w (H e,)): the closed-form ray u w^T
    "activation"  h += v = n0 s                     (s (d,)), activation addition

An edit is returned as factors dO = fP fQ^T (no (d, H e) matrix formed per target) or as the
vector v. Sizes are normalised: ||E||^2 / n0^2.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

EDITS = ("lowrank", "w_alpha", "activation")


def delta_matrix(params, u, n0, param):
    """The dense dO "(d, H e)" of a weight edit: e^a u w^T (``w_alpha``) or n0 P Q^T (``lowrank``)."""
    if param == "w_alpha":
        return jnp.exp(params["a"]) * jnp.outer(u, params["w"])
    return n0 * params["P"] @ params["Q"].T


def delta_sq(params, param):
    """||dO||_F^2 / n0^2 (lowrank) or ||dO||_F^2 / n0^2 with n0 folded in (w_alpha: e^2a ||w||^2)."""
    if param == "w_alpha":
        return jnp.exp(2 * params["a"]) * jnp.sum(params["w"] ** 2)
    P, Q = params["P"], params["Q"]          # trace(P^T P Q^T Q), elementwise (see align_lowrank)
    return jnp.sum(jnp.sum(P[:, :, None] * P[:, None, :], axis=0) * jnp.sum(Q[:, :, None] * Q[:, None, :], axis=0))


def initial_params(param: str, n0, w_hat, u0, rank: int, key, dtype) -> dict:
    """The closed form as a starting point: {a = log n0, w = w_hat} (``w_alpha``), or P, Q whose
    first columns are u0 and w_hat and whose others are small noise (``lowrank``, dO = n0 P Q^T)."""
    if param == "w_alpha":
        return {"a": jnp.log(n0), "w": w_hat}
    d, He = u0.shape[0], w_hat.shape[0]
    k1, k2 = jax.random.split(key)
    P = 1e-2 * jax.random.normal(k1, (d, rank), dtype) / np.sqrt(d)
    Q = 1e-2 * jax.random.normal(k2, (He, rank), dtype) / np.sqrt(He)
    return {"P": P.at[:, 0].set(u0), "Q": Q.at[:, 0].set(w_hat)}


def edit_factors(params, u, n0, param: str):
    """dO = factor_P factor_Q^T of a parameterisation: "(d, r)", "(H e, r)"."""
    if param == "w_alpha":
        return (jnp.exp(params["a"]) * u)[:, None], params["w"][:, None]
    return n0 * params["P"], params["Q"]


def factor_norm(fP, fQ):
    """||fP fQ^T||_F = sqrt(trace(fP^T fP fQ^T fQ)) without forming the product."""
    return jnp.sqrt(jnp.sum((fP.T @ fP) * (fQ.T @ fQ)))


def edit_of(params, u, n0, param: str):
    """The edit of a parameterisation: the factors (fP, fQ) of dO, or the vector v (activation)."""
    if param == "activation":
        return n0 * params["s"]
    return edit_factors(params, u, n0, param)


def learned(params, param: str):
    """The parameters as the optimiser sees them. ``w_alpha`` is the closed-form ray itself:
    no gradient reaches w (so Adam's update of it is exactly 0 and it stays the closed form's
    unit w_cf) and only the scale e^a is learned, so the paper's edit is one point of the
    family the optimiser searches."""
    if param == "w_alpha":
        return {"a": params["a"], "w": jax.lax.stop_gradient(params["w"])}
    return params


def edit_size(params, n0, param: str):
    """||E||^2 / n0^2."""
    if param == "activation":
        return jnp.sum(params["s"] ** 2)
    return delta_sq(params, param) / (n0 * n0 if param == "w_alpha" else 1.0)


def scaled(edit, s):
    """The edit s E: (s fP, fQ) for a factored dO, s v for a vector."""
    return (s * edit[0], edit[1]) if isinstance(edit, tuple) else s * edit
