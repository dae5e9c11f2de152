"""Figures (matplotlib, PNG) for spectra, alignment, consensus, trajectories and steering.

Every ``plot_*`` function takes NumPy arrays or plain Python values, writes one PNG
atomically (a unique temporary file beside it, then :func:`os.replace`, at ``dpi=120`` with
``bbox_inches='tight'``), and returns ``path``; with ``return_fig=True`` it returns the
:class:`matplotlib.figure.Figure` instead (still saved), for inspection in tests.

The figures are built on :class:`matplotlib.figure.Figure` directly, which renders with
the Agg canvas, so nothing here needs a display, touches pyplot's global figure registry
or changes the caller's backend; ``matplotlib.use('Agg')`` is still called when pyplot
has not been imported yet, so that a later ``import matplotlib.pyplot`` in a headless
process does not look for a GUI.

Maths drawn (design.md §2, §3):

- eigenvalues lambda of F_t in the complex plane; circles |1 + lambda| = r around -1. The
  residual layer x <- N2(x + F x) is a power step on I + F, so the outermost circle
  (through the shifted principal eigenvalue lambda_1, r = mu_1 = |1 + lambda_1|) encloses
  the whole spectrum, the second one (r = mu_2) shows the gap, and the unit circle
  |1 + lambda| = 1 separates stable consensus (mu_1 > 1) from unstable (mu_1 < 1).
- gamma_t (mean alignment with the principal subspace S_t) against its chance level
  E|cos| ~ sqrt(2 / (pi d)); rho_t (share of tokens whose alignment grows) against 0.5 and
  its controls.
- consensus distance mu(X_t) = ||X - 1 xbar^T||_F / ||X||_F on a log axis with predicted
  geometric lines C r^t.
- token paths projected on the principal plane: (e1.x, e2.x) / ||x||.
"""
from __future__ import annotations

import os
import sys
import tempfile
from typing import Dict, Mapping, Optional, Sequence, Union

import matplotlib

if "matplotlib.pyplot" not in sys.modules and "ipykernel" not in sys.modules:
    matplotlib.use("Agg")   # headless; a notebook keeps its inline backend

import numpy as np
from matplotlib import patches
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from ..dynamics.measures import wrap_angle
from ..io import public_mode

DPI = 120
__all__ = ["plot_eigenvalues", "plot_alignment", "plot_consensus", "plot_trajectories",
           "plot_histogram_before_after", "plot_curve", "plot_bars", "plot_scatter_predicted",
           "save_figure"]

ArrayOrDict = Union[np.ndarray, Sequence[float], Mapping[str, Sequence[float]]]


# --------------------------------------------------------------------------- helpers

def save_figure(fig: Figure, path, *, return_fig: bool = False):
    """Write ``fig`` to ``path`` atomically (tmp file + os.replace); return path or fig."""
    path = os.fspath(path)
    if not path.lower().endswith(".png"):
        raise ValueError(f"figure path must end in .png, got {path!r}")
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    # a unique temporary name: two runs saving the same figure never write into each other's file
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp.png", dir=parent or ".")
    try:
        with os.fdopen(fd, "wb") as fh:
            fig.savefig(fh, dpi=DPI, bbox_inches="tight", format="png")
        public_mode(tmp, 0o666)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return fig if return_fig else path


def _vector(x, name: str, n: Optional[int] = None) -> np.ndarray:
    """A 1-D float array (NaN allowed: it draws as a gap), length-checked against n."""
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a 1-D numeric array: {e}") from None
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if n is not None and a.shape[0] != n:
        raise ValueError(f"{name} has length {a.shape[0]}, expected {n} (one value per point of the x axis)")
    if np.isinf(a).any():
        raise ValueError(f"{name} contains infinite values")
    return a


def _series(y, name: str, n: int, default: str) -> Dict[str, np.ndarray]:
    """An array or a dict name -> array, as an ordered dict of checked 1-D arrays."""
    if y is None:
        return {}
    if isinstance(y, Mapping):
        if not y:
            raise ValueError(f"{name} is an empty dict")
        return {str(k): _vector(v, f"{name}[{k!r}]", n) for k, v in y.items()}
    return {default: _vector(y, name, n)}


def _band(v, name: str, n: int) -> np.ndarray:
    """A scalar or a per-point array broadcast to (n,)."""
    a = np.asarray(v, dtype=np.float64)
    if a.ndim == 0:
        a = np.full(n, float(a))
    if a.shape != (n,):
        raise ValueError(f"{name} must be a number or have length {n}, got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError(f"{name} contains non-finite values")
    return a


def _text(s) -> str:
    """A label safe from mathtext ($) with control characters made visible."""
    s = str(s)
    if any(c in s for c in "\n\t\r") or s != s.strip() or s == "":
        s = repr(s)
    return s.replace("$", r"\$")


def _errors(err, name: str, series: Mapping[str, np.ndarray], n: int) -> Dict[str, np.ndarray]:
    """Error half-widths per series: an (n,) array for the only series, or a dict with some of
    ``series``' keys; each checked non-negative where finite (NaN: no band there)."""
    if err is None:
        return {}
    if isinstance(err, Mapping):
        unknown = [k for k in err if str(k) not in series]
        if unknown:
            raise ValueError(f"{name} has keys {unknown} that are not series ({list(series)})")
        out = {str(k): _vector(v, f"{name}[{k!r}]", n) for k, v in err.items()}
    elif len(series) == 1:
        out = {next(iter(series)): _vector(err, name, n)}
    else:
        raise ValueError(f"{name} must be a dict with the keys {list(series)} when there are several series")
    for k, v in out.items():
        if (v[np.isfinite(v)] < 0).any():
            raise ValueError(f"{name}[{k!r}] has negative half-widths")
    return out


def _marker(n: int) -> str:
    return "o" if n <= 40 else ""


# --------------------------------------------------------------------------- 1. eigenvalues

def _eigen_panel(ax, s, *, zoom_inset: bool):
    """One layer's eigenvalue cloud: returns the scatter collection."""
    ev = np.asarray(s.shifted.eigenvalues)
    mu1 = float(abs(1.0 + s.shifted.top))
    mu2 = float(s.shifted.mu2)
    R = max(mu1, 1.0)
    # unit circle around -1: inside it |1 + lambda| < 1
    ax.add_patch(patches.Circle((-1.0, 0.0), 1.0, facecolor="0.88", edgecolor="0.45", lw=1.0, zorder=0,
                                label="|1+λ| < 1 (consensus unstable if λ₁ here)", gid="unit_circle"))
    ax.add_patch(patches.Circle((-1.0, 0.0), mu1, fill=False, ls="--", color="tab:red", lw=1.1, zorder=1,
                                label="|1+λ| = |1+λ₁| (shifted top)", gid="circle_mu1"))
    if 0 < mu2 < mu1:
        ax.add_patch(patches.Circle((-1.0, 0.0), mu2, fill=False, ls=":", color="tab:orange", lw=1.1, zorder=1,
                                    label="|1+λ| = μ₂ (next)", gid="circle_mu2"))
    ax.axhline(0, color="0.7", lw=0.5, zorder=0)
    ax.axvline(0, color="0.7", lw=0.5, zorder=0)
    sc = ax.scatter(ev.real, ev.imag, s=9, c="0.15", alpha=0.6, lw=0, zorder=2, label="eigenvalues λ of F",
                    gid="eigenvalues")
    ax.plot([-1.0], [0.0], marker="x", color="k", ms=7, mew=1.5, ls="", zorder=4, label="−1")
    tp, tq = complex(s.plain.top), complex(s.shifted.top)
    ax.plot([tp.real] * (2 if tp.imag else 1), [tp.imag, -tp.imag][: 2 if tp.imag else 1], marker="s", ms=8,
            mfc="none", mec="tab:blue", mew=1.6, ls="", zorder=5, label="plain top (max |λ|)")
    ax.plot([tq.real] * (2 if tq.imag else 1), [tq.imag, -tq.imag][: 2 if tq.imag else 1], marker="*", ms=12,
            color="tab:red", mec="darkred", mew=0.5, ls="", zorder=6, label="shifted top (max |1+λ|)")
    m = 1.06 * R
    ax.set_xlim(-1.0 - m, -1.0 + m)
    ax.set_ylim(-m, m)
    ax.set_aspect("equal", adjustable="box")
    ax.set_xlabel("Re λ")
    ax.set_ylabel("Im λ")
    flag = " — orderings differ" if s.orderings_differ else ""
    ax.set_title(f"layer {s.layer}{flag}", color="firebrick" if flag else "k", fontsize=10)
    ax.text(0.02, 0.02, f"|1+λ₁| = {mu1:.3g}\n|μ₂/μ₁| = {s.shifted.ratio:.3g}", transform=ax.transAxes,
            fontsize=7.5, va="bottom", ha="left", bbox=dict(fc="white", ec="0.8", alpha=0.85, pad=2))
    if zoom_inset and R > 6.0:
        # the bulk and the unit circle around -1 are specks at this scale: zoom on them
        ins = ax.inset_axes([0.60, 0.60, 0.38, 0.38])
        ins.add_patch(patches.Circle((-1.0, 0.0), 1.0, facecolor="0.88", edgecolor="0.45", lw=0.8))
        ins.scatter(ev.real, ev.imag, s=4, c="0.15", alpha=0.6, lw=0)
        ins.plot([-1.0], [0.0], marker="x", color="k", ms=5, ls="")
        near = ev[np.abs(1.0 + ev) < 0.5 * R]
        h = max(2.2, 1.1 * float(np.max(np.abs(near + 1.0)))) if near.size else 2.2
        if 0 < mu2 < 0.5 * R:
            ins.add_patch(patches.Circle((-1.0, 0.0), mu2, fill=False, ls=":", color="tab:orange", lw=1.0))
            h = max(h, 1.08 * mu2)
        ins.set_xlim(-1.0 - h, -1.0 + h)
        ins.set_ylim(-h, h)
        ins.set_aspect("equal", adjustable="box")
        ins.tick_params(labelsize=6)
        # inside the inset's top edge: above it, the title would run into the panel's own title
        ins.set_title("zoom on −1", fontsize=6.5, y=1.0, pad=-9,
                      bbox=dict(fc="white", ec="none", alpha=0.8, pad=1))
    return sc


def plot_eigenvalues(spectra, path, *, title: Optional[str] = None, max_panels: int = 36,
                     return_fig: bool = False):
    """Eigenvalues of each layer's F_t in the complex plane, one panel per layer.

    Args:
      spectra: list of :class:`powerlens._src.analysis.spectra.LayerSpectrum` (or one).
      path: the PNG to write.
      max_panels: draw at most this many layers (evenly spaced, first and last kept).

    Each panel: the eigenvalues (scatter, one point each), the unit circle |1 + λ| = 1
    around -1 (shaded; inside it consensus is unstable), dashed circles |1 + λ| = μ1
    (through the shifted principal eigenvalue, enclosing all of them) and μ2, the point -1,
    the shifted top (red star) and plain top (blue square) with their conjugates.
    """
    if hasattr(spectra, "shifted"):
        spectra = [spectra]
    spectra = list(spectra)
    if not spectra:
        raise ValueError("plot_eigenvalues: spectra is empty")
    if max_panels < 1:
        raise ValueError(f"max_panels must be >= 1, got {max_panels}")
    for i, s in enumerate(spectra):
        if not (hasattr(s, "shifted") and hasattr(s, "plain")):
            raise ValueError(f"spectra[{i}] is {type(s).__name__}, expected a LayerSpectrum")
    L = len(spectra)
    shown = spectra if L <= max_panels else [spectra[i] for i in np.unique(np.linspace(0, L - 1, max_panels).round().astype(int))]
    n = len(shown)
    ncol = 1 if n == 1 else min(n, 3 if n <= 9 else 4 if n <= 16 else 6)
    nrow = -(-n // ncol)
    size = 5.2 if n == 1 else 3.3
    # constrained layout keeps the suptitle, the panel titles and the axis labels apart
    fig = Figure(figsize=(size * ncol, size * nrow + 0.6), layout="constrained")
    axes = fig.subplots(nrow, ncol, squeeze=False)
    for ax, s in zip(axes.flat, shown):
        _eigen_panel(ax, s, zoom_inset=True)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    for ax in axes[:, 1:].flat:
        if ax.get_visible():
            ax.set_ylabel("")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    extra = [Line2D([], [], color="tab:orange", ls=":", label="|1+λ| = μ₂ (next)")]
    if "|1+λ| = μ₂ (next)" not in labels:
        handles, labels = handles + extra, labels + [extra[0].get_label()]
    sup = title or ("Eigenvalues of F = O·V" + ("" if n == 1 else " per layer"))
    if n < L:
        sup += f"  (showing {n} of {L} layers)"
    if n == 1:
        axes[0, 0].set_title(f"{sup}\n{axes[0, 0].get_title()}", color=axes[0, 0].title.get_color(), fontsize=11)
    else:
        fig.suptitle(sup)
    # below the panels, outside them: the layout makes room for it
    fig.legend(handles, labels, loc="outside lower center", ncol=2 if n == 1 else min(4, len(labels)),
               fontsize=8.5, frameon=False)
    return save_figure(fig, path, return_fig=return_fig)


# --------------------------------------------------------------------------- 2. alignment

def plot_alignment(layers_or_steps, gamma: ArrayOrDict, rho: ArrayOrDict, path, *, chance,
                   chance_band=None, gamma_controls: Optional[Mapping] = None,
                   rho_controls: Optional[Mapping] = None, xlabel: str = "layer t",
                   title: Optional[str] = None, marks: Optional[Mapping] = None, gamma_err: ArrayOrDict = None,
                   rho_err: ArrayOrDict = None, err_label: str = "±1 s.e. across prompts",
                   return_fig: bool = False):
    """gamma_t (top) and rho_t (bottom) per layer or step.

    Args:
      layers_or_steps: x values (n,).
      gamma, rho: (n,) arrays or dicts name -> (n,) (e.g. {'shifted': ..., 'plain': ...}).
        NaN draws as a gap (rho undefined).
      chance: chance level of gamma, a number or (n,) (it depends on dim S_t).
      chance_band: half-width of the chance band (e.g. 2 std / sqrt(tokens)), number or (n,).
      gamma_controls, rho_controls: dicts name -> (n,) drawn dashed ('random subspace',
        'other layer'); a control that is NaN everywhere (no other layer in a one-layer
        model) is left out, legend entry included.
      marks: dict label -> x values to shade on both panels (e.g. {'global attention': [6, 12]}).
      gamma_err, rho_err: half-widths of an error band around gamma / rho, (n,) or dicts with
        the keys of ``gamma`` / ``rho`` (e.g. the standard errors across prompts); NaN: no band
        there. ``err_label``: the band's legend entry.

    The legends sit to the right of the panels, so that they never cover a point.
    """
    x = _vector(layers_or_steps, "layers_or_steps")
    n = x.shape[0]
    if n == 0:
        raise ValueError("layers_or_steps is empty")
    g = _series(gamma, "gamma", n, "γ_t")
    r = _series(rho, "rho", n, "ρ_t")
    if not g or not r:
        raise ValueError("plot_alignment needs gamma and rho")
    drawn = lambda d: {k: v for k, v in d.items() if np.isfinite(v).any()}
    gc = drawn(_series(gamma_controls, "gamma_controls", n, "control"))
    rc = drawn(_series(rho_controls, "rho_controls", n, "control"))
    ge = _errors(gamma_err, "gamma_err", g, n)
    re_ = _errors(rho_err, "rho_err", r, n)
    ch = _band(chance, "chance", n)
    mk = _marker(n)
    fig = Figure(figsize=(8.0, 6.4))
    ax1, ax2 = fig.subplots(2, 1, sharex=True)
    width = float(np.min(np.diff(np.sort(x)))) if n > 1 else 1.0
    for i, (label, xs) in enumerate((marks or {}).items()):
        for ax in (ax1, ax2):
            for j, xm in enumerate(np.atleast_1d(np.asarray(xs, float))):
                ax.axvspan(xm - width / 2, xm + width / 2, color=("#f2c14e", "#9ecae1", "#c7e9c0")[i % 3],
                           alpha=0.45, lw=0, zorder=0, label=label if j == 0 else None)
    if chance_band is not None:
        b = _band(chance_band, "chance_band", n)
        ax1.fill_between(x, ch - b, ch + b, color="0.85", lw=0, label="chance ± band", step=None)
    ax1.plot(x, ch, color="0.35", ls="--", lw=1.2, label="chance (random direction)")
    banded = [False]

    def band(ax, i, v, e):
        if e is not None and np.isfinite(e).any():
            ax.fill_between(x, v - e, v + e, color=f"C{i}", alpha=0.18, lw=0, zorder=1,
                            label=None if banded[0] else err_label, gid="error_band")
            banded[0] = True

    for i, (k, v) in enumerate(g.items()):
        band(ax1, i, v, ge.get(k))
        ax1.plot(x, v, marker=mk, ms=4, lw=1.6, color=f"C{i}", label=f"γ_t {k}" if k != "γ_t" else k)
    for j, (k, v) in enumerate(gc.items()):
        ax1.plot(x, v, ls=(0, (4, 2)), marker=mk and ".", lw=1.1, color=f"C{len(g) + j + 2}", label=k)
    ax1.set_ylabel("γ_t = mean ‖P_S x‖/‖x‖")
    tops = [v + np.nan_to_num(ge[k]) if k in ge else v for k, v in g.items()]
    hi = np.nanmax(np.concatenate([*tops, *gc.values(), ch + (b if chance_band is not None else 0)]))
    ax1.set_ylim(0, min(1.02, max(0.05, 1.15 * hi)) if np.isfinite(hi) else 1.02)
    ax1.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.85)
    ax1.set_title("alignment with the principal subspace S_t", fontsize=10)
    ax1.grid(alpha=0.3)

    ax2.axhline(0.5, color="0.35", ls="--", lw=1.2, label="0.5 (no preference)")
    banded[0] = False
    for i, (k, v) in enumerate(r.items()):
        band(ax2, i, v, re_.get(k))
        ax2.plot(x, v, marker=mk, ms=4, lw=1.6, color=f"C{i}", label=f"ρ_t {k}" if k != "ρ_t" else k)
    for j, (k, v) in enumerate(rc.items()):
        ax2.plot(x, v, ls=(0, (4, 2)), marker=mk and ".", lw=1.1, color=f"C{len(r) + j + 2}", label=k)
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_ylabel("ρ_t = share of tokens with γ up")
    ax2.set_xlabel(xlabel)
    ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.85)
    ax2.set_title("share of tokens whose alignment grows across the step", fontsize=10)
    ax2.grid(alpha=0.3)
    if n <= 40 and np.allclose(x, np.round(x)):
        ax2.set_xticks(x if n <= 16 else x[:: int(np.ceil(n / 16))])
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path, return_fig=return_fig)


# --------------------------------------------------------------------------- 3. consensus

def _positive(a):
    a = np.array(a, dtype=np.float64)
    a[~(a > 0)] = np.nan          # log axis: zero / negative / NaN draw as gaps
    return a


def plot_consensus(consensus, path, *, rank_collapse=None, pairwise_cos=None, predicted_rate=None,
                   fit_start: int = 0, steps=None, title: Optional[str] = None, return_fig: bool = False):
    """Consensus distance mu(X_t) per step on a log axis, and the mean pairwise cosine.

    Args:
      consensus: (T+1,) mu(X_t) = ||X - 1 xbar^T||_F / ||X||_F, t = 0..T.
      rank_collapse: (T+1,) residual of Dong et al., drawn on the same log axis.
      pairwise_cos: (T+1,) mean pairwise cosine, on a second (linear) panel.
      predicted_rate: r or dict name -> r; draws C r^t with C fixed so that the line passes
        through consensus[fit_start] (e.g. {'1/|μ1|': ..., '|μ2/μ1|': ...}).
      steps: x values (T+1,), default 0..T.
    """
    c = _vector(consensus, "consensus")
    T1 = c.shape[0]
    if T1 == 0:
        raise ValueError("consensus is empty")
    t = np.arange(T1, dtype=np.float64) if steps is None else _vector(steps, "steps", T1)
    rc = None if rank_collapse is None else _vector(rank_collapse, "rank_collapse", T1)
    pc = None if pairwise_cos is None else _vector(pairwise_cos, "pairwise_cos", T1)
    rates = {} if predicted_rate is None else (
        {str(k): float(v) for k, v in predicted_rate.items()} if isinstance(predicted_rate, Mapping)
        else {"predicted": float(predicted_rate)})
    for k, v in rates.items():
        if not (np.isfinite(v) and v > 0):
            raise ValueError(f"predicted_rate {k!r} must be a positive finite number, got {v}")
    if rates and not (0 <= fit_start < T1):
        raise ValueError(f"fit_start={fit_start} is outside 0..{T1 - 1}")
    fig = Figure(figsize=(8.0, 6.4 if pc is not None else 4.0))
    axes = fig.subplots(2 if pc is not None else 1, 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    cp = _positive(c)
    mk = _marker(T1)
    ax.plot(t, cp, lw=1.8, marker=mk, ms=3, color="C0", label="μ(X_t) = ‖X − 1x̄ᵀ‖_F / ‖X‖_F")
    if rc is not None:
        ax.plot(t, _positive(rc), lw=1.4, marker=mk and ".", color="C1", label="rank-collapse residual")
    finite = cp[np.isfinite(cp)]
    if rates:
        c0 = c[fit_start]
        if not c0 > 0:
            raise ValueError(f"consensus[{fit_start}] = {c0} is not positive: pick another fit_start")
        for j, (k, r) in enumerate(rates.items()):
            ts = t[fit_start:]
            ax.plot(ts, c0 * r ** (ts - ts[0]), ls="--", lw=1.2, color=f"C{j + 2}",
                    label=f"{k}: C·r^t, r = {r:.4g}")
    if finite.size:
        lo = max(np.min(finite) / 3.0, 1e-17)
        hi = np.max(finite) * 3.0
        if rc is not None and np.isfinite(_positive(rc)).any():
            rcp = _positive(rc)
            lo, hi = min(lo, np.nanmin(rcp) / 3.0), max(hi, np.nanmax(rcp) * 3.0)
        ax.set_yscale("log")
        ax.set_ylim(lo, hi)
    ax.set_ylabel("consensus distance (log scale)")
    ax.legend(fontsize=8, loc="best", framealpha=0.85)
    ax.grid(alpha=0.3)
    ax.set_title("distance to consensus", fontsize=10)
    if pc is not None:
        a2 = axes[1]
        a2.plot(t, pc, lw=1.6, marker=mk, ms=3, color="C4", label="mean pairwise cos(x_i, x_j)")
        a2.axhline(1.0, color="0.5", ls=":", lw=1, label="consensus (cos = 1)")
        a2.axhline(0.0, color="0.7", lw=0.6)
        lo2 = np.nanmin(pc) if np.isfinite(pc).any() else -1.0
        a2.set_ylim(max(-1.05, min(-0.05, lo2 - 0.05)), 1.05)
        a2.set_ylabel("mean pairwise cosine")
        a2.legend(fontsize=8, loc="best", framealpha=0.85)
        a2.grid(alpha=0.3)
    axes[-1].set_xlabel("step t")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path, return_fig=return_fig)


# --------------------------------------------------------------------------- 4. trajectories

def plot_trajectories(states, basis, path, *, max_tokens: int = 32, title: Optional[str] = None,
                      return_fig: bool = False):
    """Token paths projected on the principal plane.

    Args:
      states: (T+1, n, d) token states (or (T+1, B, n, d): prompts are pooled).
      basis: (d, 2) orthonormal basis (e1, e2) of S; each token is drawn at
        (e1.x, e2.x) / ||x||, inside the unit disc (on its rim when x lies in S).
        A (d, 1) basis draws the coordinate e1.x / ||x|| against the step instead.
      max_tokens: draw at most this many tokens (evenly spaced).
    """
    X = np.asarray(states, dtype=np.float64)
    if X.ndim == 4:
        X = X.reshape(X.shape[0], -1, X.shape[-1])
    if X.ndim != 3:
        raise ValueError(f"states must have shape (T+1, n, d) or (T+1, B, n, d), got {X.shape}")
    B = np.asarray(basis, dtype=np.float64)
    if B.ndim == 1:
        B = B[:, None]
    if B.ndim != 2 or B.shape[0] != X.shape[2] or B.shape[1] not in (1, 2):
        raise ValueError(f"basis must have shape (d, 2) or (d, 1) with d={X.shape[2]}, got {B.shape}")
    if not (np.isfinite(X).all() and np.isfinite(B).all()):
        raise ValueError("states/basis contain non-finite values")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    T1, n, _ = X.shape
    idx = np.unique(np.linspace(0, n - 1, min(n, max_tokens)).round().astype(int))
    norms = np.linalg.norm(X[:, idx], axis=-1, keepdims=True)
    C = np.einsum("tnd,dk->tnk", X[:, idx], B) / np.where(norms > 0, norms, np.nan)   # (T+1, m, k)
    colors = matplotlib.colormaps["viridis"](np.linspace(0, 0.95, len(idx)))
    fig = Figure(figsize=(6.4, 6.0) if B.shape[1] == 2 else (8.0, 4.2))
    ax = fig.subplots()
    sub = f"{len(idx)} of {n} tokens, {T1 - 1} steps"
    if B.shape[1] == 2:
        th = np.linspace(0, 2 * np.pi, 361)
        ax.plot(np.cos(th), np.sin(th), color="0.5", ls="--", lw=1, label="unit circle (token in S)")
        ax.axhline(0, color="0.8", lw=0.6)
        ax.axvline(0, color="0.8", lw=0.6)
        for j in range(len(idx)):
            ax.plot(C[:, j, 0], C[:, j, 1], color=colors[j], lw=0.9, alpha=0.8)
        ax.scatter(C[0, :, 0], C[0, :, 1], s=28, facecolors="none", edgecolors=colors, lw=1.2, zorder=3)
        ax.scatter(C[-1, :, 0], C[-1, :, 1], s=34, c=colors, marker="o", edgecolors="k", lw=0.6, zorder=4)
        ax.set_xlim(-1.12, 1.12)
        ax.set_ylim(-1.12, 1.12)
        ax.set_aspect("equal", adjustable="box")
        ax.set_xlabel("e₁·x / ‖x‖  (Re v₁ direction)")
        ax.set_ylabel("e₂·x / ‖x‖  (Im v₁ direction)")
    else:
        t = np.arange(T1)
        for j in range(len(idx)):
            ax.plot(t, C[:, j, 0], color=colors[j], lw=0.9, alpha=0.8)
        ax.scatter(np.zeros(len(idx)), C[0, :, 0], s=28, facecolors="none", edgecolors=colors, zorder=3)
        ax.scatter(np.full(len(idx), T1 - 1), C[-1, :, 0], s=34, c=colors, edgecolors="k", lw=0.6, zorder=4)
        for y in (-1, 1):
            ax.axhline(y, color="0.5", ls="--", lw=1, label="±1 (token along ±v₁)" if y == 1 else None)
        ax.set_ylim(-1.08, 1.08)
        ax.set_xlabel("step t")
        ax.set_ylabel("e₁·x / ‖x‖  (cos with v₁)")
    h = ax.get_legend_handles_labels()[0]
    h += [Line2D([], [], marker="o", mfc="none", mec="0.3", ls="", label="start (t = 0)"),
          Line2D([], [], marker="o", mfc="0.3", mec="k", ls="", label=f"end (t = {T1 - 1})")]
    ax.legend(handles=h, fontsize=8, loc="upper right", framealpha=0.85)
    ax.set_title((title + "\n" if title else "Token trajectories in the principal subspace\n") + sub, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path, return_fig=return_fig)


# --------------------------------------------------------------------------- 5-8 generic

def plot_histogram_before_after(before, after, path, *, xlabel: str = "alignment", bins: int = 40,
                                title: Optional[str] = None, return_fig: bool = False):
    """Overlaid histograms of a per-token quantity before / after (shared bins, mean lines)."""
    b = _vector(np.ravel(before), "before")
    a = _vector(np.ravel(after), "after")
    b, a = b[np.isfinite(b)], a[np.isfinite(a)]
    if b.size == 0 or a.size == 0:
        raise ValueError(f"before ({b.size}) and after ({a.size}) need at least one finite value each")
    lo, hi = float(min(b.min(), a.min())), float(max(b.max(), a.max()))
    if 0.0 <= lo and hi <= 1.0:
        lo, hi = 0.0, 1.0
    elif hi == lo:
        lo, hi = lo - 0.5, hi + 0.5
    edges = np.linspace(lo, hi, bins + 1)
    fig = Figure(figsize=(7.0, 4.2))
    ax = fig.subplots()
    ax.hist(b, bins=edges, color="C0", alpha=0.55, label=f"before (n = {b.size})", gid="before")
    ax.hist(a, bins=edges, color="C3", alpha=0.55, label=f"after (n = {a.size})", gid="after")
    ax.axvline(b.mean(), color="C0", ls="--", lw=1.5, label=f"mean before = {b.mean():.3g}")
    ax.axvline(a.mean(), color="C3", ls="--", lw=1.5, label=f"mean after = {a.mean():.3g}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("tokens (count)")
    ax.set_xlim(lo, hi)
    ax.legend(fontsize=8, loc="upper center", framealpha=0.85)
    ax.set_title(title or f"{xlabel}: before vs after", fontsize=11)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path, return_fig=return_fig)


def plot_curve(x, ys: ArrayOrDict, path, *, xlabel: str, ylabel: str, logx: bool = False, logy: bool = False,
               hlines=None, title: Optional[str] = None, intervals: Optional[Mapping] = None,
               interval_label: str = "", ylim: Optional[Sequence[float]] = None, return_fig: bool = False):
    """A generic line plot: ys is an array or dict name -> (n,); hlines a number, a list
    or a dict name -> value (horizontal reference lines).

    ``intervals``: dict name (a key of ``ys``) -> (low "float[n]", high "float[n]"), the bounds
    of an interval around each point (e.g. a binomial confidence interval), drawn as error
    bars and named in the legend by ``interval_label``. ``ylim``: (bottom, top) of the y axis
    (None: matplotlib's choice)."""
    xv = _vector(x, "x")
    n = xv.shape[0]
    if n == 0:
        raise ValueError("x is empty")
    series = _series(ys, "ys", n, ylabel)
    if not series:
        raise ValueError("plot_curve needs at least one series in ys")
    if logx and not (xv[np.isfinite(xv)] > 0).all():
        raise ValueError("logx=True needs positive x values")
    if hlines is None:
        hl = {}
    elif isinstance(hlines, Mapping):
        hl = {str(k): float(v) for k, v in hlines.items()}
    else:
        hl = {f"{float(v):.3g}": float(v) for v in np.atleast_1d(np.asarray(hlines, dtype=np.float64))}
    fig = Figure(figsize=(7.0, 4.4))
    ax = fig.subplots()
    mk = _marker(n)
    bounds = {}
    for k, lh in (intervals or {}).items():
        if str(k) not in series:
            raise ValueError(f"intervals has the key {k!r}, which is not a series ({list(series)})")
        lo, hi = (_vector(b, f"intervals[{k!r}]", n) for b in lh)
        bounds[str(k)] = (lo, hi)
    for i, (k, v) in enumerate(series.items()):
        y = _positive(v) if logy else v
        label = k + (f" ({interval_label})" if interval_label and k in bounds else "")
        if k in bounds:
            lo, hi = bounds[k]
            err = np.stack([np.clip(y - lo, 0, None), np.clip(hi - y, 0, None)])
            ax.errorbar(xv, y, yerr=err, marker=mk, ms=4, lw=1.6, color=f"C{i}", label=label, capsize=3,
                        elinewidth=1.0, gid=f"interval {k}")
        else:
            ax.plot(xv, y, marker=mk, ms=4, lw=1.6, color=f"C{i}", label=label)
    if ylim is not None:
        ax.set_ylim(*ylim)
    for j, (k, v) in enumerate(hl.items()):
        ax.axhline(v, color=f"C{len(series) + j}", ls="--", lw=1.1, alpha=0.8, label=k)
    if logx:
        ax.set_xscale("log")
    elif np.all(xv[np.isfinite(xv)] == np.round(xv[np.isfinite(xv)])):   # layers, steps: whole ticks only
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if len(series) + len(hl) > 1 or isinstance(ys, Mapping):
        ax.legend(fontsize=8, loc="best", framealpha=0.85)
    ax.grid(alpha=0.3, which="both")
    if title:
        ax.set_title(title, fontsize=11)
    fig.tight_layout()
    return save_figure(fig, path, return_fig=return_fig)


def plot_bars(labels, values_before, values_after, path, *, ylabel: str = "probability",
              xlabel: str = "token", title: Optional[str] = None, return_fig: bool = False):
    """Grouped bars (e.g. top-k next-token probabilities) before / after steering."""
    labels = [_text(s) for s in labels]
    k = len(labels)
    if k == 0:
        raise ValueError("labels is empty")
    b = _vector(values_before, "values_before", k)
    a = _vector(values_after, "values_after", k)
    if not (np.isfinite(b).all() and np.isfinite(a).all()):
        raise ValueError("values_before/values_after contain NaN")
    xs = np.arange(k)
    w = 0.4
    fig = Figure(figsize=(max(6.0, 0.55 * k + 2.5), 4.4))
    ax = fig.subplots()
    ax.bar(xs - w / 2, b, w, color="C0", label="before", gid="before")
    ax.bar(xs + w / 2, a, w, color="C3", label="after", gid="after")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, rotation=45 if k > 6 or max(map(len, labels)) > 6 else 0, ha="right" if k > 6 else "center",
                       fontsize=9)
    ax.set_ylabel(ylabel)
    ax.set_xlabel(xlabel)
    if ylabel == "probability" and max(b.max(), a.max()) <= 1.0:
        ax.set_ylim(0, min(1.0, 1.15 * max(b.max(), a.max(), 1e-12)))
    ax.legend(fontsize=9, framealpha=0.85)
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(title or f"{ylabel}: before vs after", fontsize=11)
    fig.tight_layout()
    return save_figure(fig, path, return_fig=return_fig)


def plot_group_bars(groups, series, path, *, ylabel: str, xlabel: str = "", logy: bool = False,
                    title: Optional[str] = None, return_fig: bool = False):
    """Bars of several named series (dict name -> values, one per group) side by side per group."""
    groups = [_text(g) for g in groups]
    k = len(groups)
    if k == 0 or not series:
        raise ValueError("groups and series must be non-empty")
    vals = {name: _vector(v, f"series {name!r}", k) for name, v in series.items()}
    m = len(vals)
    w = 0.8 / m
    xs = np.arange(k)
    fig = Figure(figsize=(max(6.0, 1.2 * k * m + 2.0), 4.4))
    ax = fig.subplots()
    for j, (name, v) in enumerate(vals.items()):
        pos = xs - 0.4 + w * (j + 0.5)
        bars = ax.bar(pos, np.where(np.isfinite(v), v, 0.0), w, color=f"C{j}", label=_text(name))
        for b, val in zip(bars, v):
            ax.annotate(f"{val:.3g}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 2), textcoords="offset points")
    if logy:
        ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels(groups, fontsize=9)
    ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.legend(fontsize=9, framealpha=0.85)
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(title or ylabel, fontsize=11)
    fig.tight_layout()
    return save_figure(fig, path, return_fig=return_fig)


def plot_scatter_predicted(predicted, measured, path, *, xlabel: str, ylabel: str, title: Optional[str] = None,
                           angles: bool = False, return_fig: bool = False):
    """Measured against predicted values with the line y = x (e.g. rates vs |mu2/mu1|).

    ``angles``: the values are angles (radians), and each measured one is drawn, and its
    error taken, on the branch nearest its prediction, p + wrap(m - p): a rotation measured
    as -pi + 0.001 against a predicted pi - 0.001 is 0.002 off, not 2 pi."""
    p = _vector(np.ravel(predicted), "predicted")
    m = _vector(np.ravel(measured), "measured", p.shape[0])
    ok = np.isfinite(p) & np.isfinite(m)
    if not ok.any():
        raise ValueError("predicted/measured have no finite pair")
    p, m = p[ok], m[ok]
    if angles:
        m = p + np.asarray(wrap_angle(m - p))
    lo, hi = float(min(p.min(), m.min())), float(max(p.max(), m.max()))
    pad = 0.05 * (hi - lo) if hi > lo else 0.5
    lo, hi = lo - pad, hi + pad
    fig = Figure(figsize=(5.6, 5.4))
    ax = fig.subplots()
    ax.plot([lo, hi], [lo, hi], color="0.4", ls="--", lw=1.2, label="y = x", gid="diagonal")
    err = np.median(np.abs(m - p))
    ax.scatter(p, m, s=18, alpha=0.7, color="C0", edgecolors="none",
               label=f"{p.size} points, median |meas − pred| = {err:.2g}", gid="points")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_aspect("equal", adjustable="box")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8, loc="lower right", framealpha=0.85)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title, fontsize=11)
    fig.tight_layout()
    return save_figure(fig, path, return_fig=return_fig)
