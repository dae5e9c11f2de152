"""The table's measured columns, reduced from the raw outputs of :mod:`powerlens._src.sweeps.measures`.

Host side, float64, vectorised over the S systems of a chunk (no loop over systems).
lambda_1, lambda_2, lambda_3 are in the shifted order (lambda_2: the first eigenvalue after
the principal group, design.md §2). Each column, with NaN/None where it is undefined:

    lambda1_re, lambda1_im, lambda2_re, lambda2_im
    principal_dim          dimension of the principal (shifted) eigenvalue group
    consensus_rate_pred    1/|1+lambda_1|
    direction_rate_pred    |1+lambda_2|/|1+lambda_1|
    rotation_pred          arg(1+lambda_1), only for a complex pair
    top2_rate_pred         |1+lambda_3|/|1+lambda_1| (into the span of the top two groups)
    consensus_rate         measured rate of mu(X_t)
    direction_rate         measured rate of tan(token mean, principal subspace)
    top2_rate              measured rate of tan(token mean, top-two subspace)
    rotation               mean angle step in the principal plane over the last steps
                           (:func:`~powerlens._src.dynamics.measures.mean_angle`: steps near
                           +-pi on one branch)
    final_gamma            gamma against the principal subspace after the last step
    mean_rho               rho against the principal subspace, averaged over the steps
    final_consensus        mu(X_T)
    bipartite_final        every token within ``bipartite_cos`` of +-v1 and both signs present
    bipartite_drift        largest sin(token, v1) one step after the exact +-v1 start
    converged              final_consensus <= converged_consensus and final_gamma >= converged_gamma
    finite                 every state x_0 .. x_T of the run finite and non-zero (the scan's own
                           ``finite`` observer)

A row whose run went non-finite (``finite`` False: an overflow, a NaN, a token without a
direction) reports no measure of its states: every column of :data:`OF_STATES` and its
series are null. A series is the column of its own name, except ``rotation``, whose name is
the scalar column's: its series is ``rotation_series`` (:func:`series_column`). The spectral columns (lambda, the predictions, principal_dim) describe
the system itself and stay.

A measured rate is the asymptotic one (:func:`fit_rates`): exp of the least-squares slope
of log(value) against t over a window of steps. ``"auto"`` takes the later half of the
steps before the value first falls to 100 eps of the system's precision (the opening
transient is over by then and the value is still far above rounding); an explicit window
[lo, hi] takes every step with lo < value < hi. Fewer than 3 steps: undefined.
"""
from __future__ import annotations

from typing import Dict, Mapping

import numpy as np

from ..dynamics.measures import mean_angle
from jaxtyping import ArrayLike, Float, Real

MEASURED = ("lambda1_re", "lambda1_im", "lambda2_re", "lambda2_im", "principal_dim",
            "consensus_rate_pred", "direction_rate_pred", "rotation_pred", "top2_rate_pred",
            "consensus_rate", "direction_rate", "rotation", "top2_rate",
            "final_gamma", "mean_rho", "final_consensus", "bipartite_final", "bipartite_drift", "converged",
            "finite")
OF_STATES = ("consensus_rate", "direction_rate", "rotation", "top2_rate", "final_gamma", "mean_rho",
             "final_consensus", "bipartite_final", "bipartite_drift", "converged")
"""The columns measured on the states: null in a row whose run went non-finite."""
RATES = (("consensus_rate", "consensus_rate_pred"), ("direction_rate", "direction_rate_pred"),
         ("rotation", "rotation_pred"), ("top2_rate", "top2_rate_pred"))
BOOLEAN = ("bipartite_final", "converged")
INTEGER = ("principal_dim",)
MIN_POINTS = 3


def fit_rates(values: Real[ArrayLike, "S L"], window="auto", eps: float = np.finfo(np.float64).eps,
              min_points: int = MIN_POINTS) -> Float[np.ndarray, "S"]:
    """exp(slope) of log(values) over each row's window (module docstring); NaN if too few points."""
    v = np.atleast_2d(np.asarray(values, np.float64))
    t = np.arange(v.shape[1], dtype=np.float64)
    finite = np.isfinite(v)
    if isinstance(window, str):
        above = finite & (v > 100.0 * eps)
        end = np.where(above.all(axis=1), v.shape[1], np.argmin(above, axis=1))
        mask = (t[None] >= (end // 2)[:, None]) & (t[None] < end[:, None])
    else:
        lo, hi = window
        with np.errstate(invalid="ignore"):
            mask = finite & (v > lo) & (v < hi)
    n = mask.sum(axis=1)
    w = mask.astype(np.float64)
    y = np.log(np.where(mask, v, 1.0))
    with np.errstate(invalid="ignore", divide="ignore"):
        tm = (w * t).sum(axis=1) / n
        ym = (w * y).sum(axis=1) / n
        dt = (t[None] - tm[:, None]) * w
        slope = (dt * (y - ym[:, None])).sum(axis=1) / (dt * dt).sum(axis=1)
    return np.where(n >= min_points, np.exp(slope), np.nan)


def _complex(lam):
    return lam[..., 0] + 1j * lam[..., 1]


def predicted(lam: Real[ArrayLike, "S 3 2"]) -> Dict[str, np.ndarray]:
    """The spectral columns of S systems from lambda_1..3 (shifted order, NaN where absent)."""
    z = _complex(np.asarray(lam, np.float64))
    key = np.abs(1.0 + z)
    pair = np.abs(z[:, 0].imag) > 1e-9 * (1.0 + np.abs(z[:, 0]))
    return {"lambda1_re": z[:, 0].real, "lambda1_im": z[:, 0].imag,
            "lambda2_re": z[:, 1].real, "lambda2_im": z[:, 1].imag,
            "consensus_rate_pred": 1.0 / key[:, 0], "direction_rate_pred": key[:, 1] / key[:, 0],
            "rotation_pred": np.where(pair, np.angle(1.0 + z[:, 0]), np.nan),
            "top2_rate_pred": key[:, 2] / key[:, 0]}


def _unit(x):
    x = np.asarray(x, np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def is_bipartite(final, v1, valid, cos: float):
    """(bipartite_final, bipartite_drift-ready cosines): does every valid token lie within
    ``cos`` of +-v1, with both signs present? NaN where v1 is undefined (zero)."""
    c = np.einsum("snd,sd->sn", _unit(final), v1)
    stays = (np.all((np.abs(c) > cos) | ~valid, axis=1) & np.any((c > 0) & valid, axis=1)
             & np.any((c < 0) & valid, axis=1))
    return stays


def drift(x1, v1, valid):
    """max over valid tokens of sin(x1_i, v1) "float[S]"."""
    off = np.sqrt(np.maximum(1 - np.einsum("snd,sd->sn", _unit(x1), v1) ** 2, 0))
    return np.max(np.where(valid, off, -np.inf), axis=-1)


def series_column(name: str) -> str:
    """The table column of per-step series ``name``: the name itself, or ``NAME_series`` where
    a scalar column already has that name (``rotation``)."""
    return name + "_series" if name in MEASURED else name


def reduce(raw: Mapping[str, np.ndarray], measure: Mapping, eps: float, series=()) -> Dict[str, list]:
    """The measured columns (module docstring) of S systems from their raw outputs, as
    JSON-ready lists (None where undefined), plus the requested ``series`` as lists."""
    S = raw["consensus"].shape[0]
    out = predicted(raw["lam"])
    out["principal_dim"] = np.asarray(raw["dim"], np.int64)
    out["consensus_rate"] = fit_rates(raw["consensus"], measure["consensus_window"], eps)
    out["direction_rate"] = fit_rates(raw["direction_tan"], measure["direction_window"], eps)
    out["top2_rate"] = (fit_rates(raw["top2_tan"], measure["top2_window"], eps) if "top2_tan" in raw
                        else np.full(S, np.nan))
    rot = np.asarray(raw["rotation"], np.float64)
    K = measure["rotation_steps"] or max(rot.shape[1] // 2, 1)
    last = rot[:, -K:]                                  # NaN (no complex pair) stays NaN
    out["rotation"] = mean_angle(last, np.ones(last.shape, bool))
    gamma = np.asarray(raw["gamma"], np.float64)
    out["final_gamma"] = gamma[:, -1]
    out["mean_rho"] = np.mean(np.asarray(raw["rho"], np.float64), axis=1)
    out["final_consensus"] = np.asarray(raw["consensus"], np.float64)[:, -1]
    v1 = np.asarray(raw["v1"], np.float64)
    valid = np.asarray(raw["valid"], bool)
    defined = np.linalg.norm(v1, axis=1) > 0
    stays = is_bipartite(raw["final"], v1, valid, measure["bipartite_cos"])
    out["bipartite_final"] = [bool(s) if ok else None for s, ok in zip(stays, defined)]
    out["bipartite_drift"] = (np.where(defined, drift(raw["exact_step"], v1, valid), np.nan)
                              if "exact_step" in raw else np.full(S, np.nan))
    with np.errstate(invalid="ignore"):
        out["converged"] = ((out["final_consensus"] <= measure["converged_consensus"])
                            & (out["final_gamma"] >= measure["converged_gamma"]))
    ok = np.all(np.asarray(raw["finite"], bool).reshape(S, -1), axis=1)
    out["finite"] = ok
    cols = {}
    for name in MEASURED:
        v = out[name]
        if isinstance(v, list):
            cols[name] = v
        elif name in BOOLEAN or name == "finite":
            cols[name] = [bool(x) for x in v]
        elif name in INTEGER:
            cols[name] = [int(x) for x in v]
        else:
            cols[name] = [None if not np.isfinite(x) else float(x) for x in np.asarray(v, np.float64)]
    kept = [name for name in series if name in raw]
    for name in kept:
        cols[series_column(name)] = np.asarray(raw[name], np.float64).tolist()
    for name in [*OF_STATES, *(series_column(k) for k in kept)]:
        cols[name] = [x if good else None for x, good in zip(cols[name], ok)]
    return cols


def to_frame(chunks):
    """One pandas DataFrame from stored chunks (``{"system": ids, "columns": {...}}``), one
    row per system in system order; booleans with nulls become pandas' ``boolean``."""
    import pandas as pd
    cols: Dict[str, list] = {}
    ids: list = []
    for c in chunks:
        ids += c["system"]
        for k, v in c["columns"].items():
            cols.setdefault(k, []).extend(v)
    order = np.argsort(np.asarray(ids, np.int64), kind="stable")
    df = pd.DataFrame(cols).iloc[order]
    for name in BOOLEAN:
        if name in df:
            df[name] = df[name].astype("boolean")
    for name in MEASURED:
        if name in df and name not in BOOLEAN + INTEGER + ("finite",):
            df[name] = df[name].astype("float64")
    if "finite" in df:
        df["finite"] = df["finite"].astype(bool)
    return df.reset_index(drop=True)
