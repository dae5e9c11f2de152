"""One measured run of a system: spectra -> reference subspaces -> chunked simulation
(with a progress bar) -> pooled per-state measures (:class:`StepMeasures`), ready for
plots, and for JSON/CSV through :meth:`StepMeasures.rows`.

The simulation is run in chunks of the schedule (:func:`chunk_steps`: 100 steps, up to
10⁴ for long runs) so that long runs show progress, can be interrupted between chunks and
keep on the device only one chunk's outputs; each chunk is the same jitted
``simulate_batch`` call. After every chunk the states and the measures are checked: the
first non-finite one stops the run with a :class:`NonFiniteStateError` naming its step,
so that no number measured on inf or NaN is ever reported.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import sys
from typing import Dict, List, Optional

import numpy as np

from ..dynamics.inputs import check_tokens
from ..dynamics.options import Dynamics, as_dynamics
from ..dynamics.params import Layers
from ..dynamics.schedule import Schedule
from ..dynamics.simulate import pooled, simulate_batch
from ..dynamics.subspaces import Subspaces
from .measures import binomial_pvalue, chance_gamma, chance_gamma_std
from .spectra import LayerSpectrum, check_order, reference_subspaces, spectra_of


@dataclasses.dataclass
class StepMeasures:
    """Pooled measures of a run (over prompts, weighted by valid tokens), one entry per state
    t = 0 .. T: every array is "[T+1]", index 0 the initial state x_0.

    A measure of a step (rho and its controls, its p-value, rotation) is NaN at t = 0;
    gamma at t = 0 is that of x_0 against the references of the first step's layer.

    Attributes:
      t: "int[T+1]" the state index.
      layer: "int[T+1]" the unique layer whose step produced state t (-1 at t = 0).
      gamma, gamma_random, gamma_other_layer: "float[T+1]" mean gamma_i against the
        principal subspace and the two controls (the references read by name).
      rho, rho_random, rho_other_layer: "float[T+1]" share of tokens whose gamma grew.
      rotation: "float[T+1]" mean angle step in the principal plane (NaN unless a complex pair).
      rho_pvalue: "float[T+1]" one-sided binomial p-value of rho > 1/2.
      consensus, rank_collapse, pairwise_cos: "float[T+1]" (mean over prompts).
      chance_gamma, chance_band: "float[T+1]" chance level of gamma (random direction) and
        the half-width 2 sd / sqrt(tokens) of its band.
      n_tokens: number of valid tokens pooled.
      prompt_gamma, prompt_rho: "float[B T+1]" gamma and rho against the principal subspace of
        each of the B prompts alone (its mean over its own valid tokens; rho NaN at t = 0), or
        None when not kept; ``gamma`` and ``rho`` are their means weighted by ``prompt_tokens``.
      prompt_tokens: "int[B]" valid tokens of each prompt (None when not kept).
    """

    t: np.ndarray
    layer: np.ndarray
    gamma: np.ndarray
    rho: np.ndarray
    rotation: np.ndarray
    gamma_random: np.ndarray
    rho_random: np.ndarray
    gamma_other_layer: np.ndarray
    rho_other_layer: np.ndarray
    rho_pvalue: np.ndarray
    consensus: np.ndarray
    rank_collapse: np.ndarray
    pairwise_cos: np.ndarray
    chance_gamma: np.ndarray
    chance_band: np.ndarray
    n_tokens: int
    prompt_gamma: Optional[np.ndarray] = None
    prompt_rho: Optional[np.ndarray] = None
    prompt_tokens: Optional[np.ndarray] = None

    COLUMNS = ("t", "layer", "gamma", "rho", "rotation", "gamma_random", "rho_random", "gamma_other_layer",
               "rho_other_layer", "rho_pvalue", "consensus", "rank_collapse", "pairwise_cos", "chance_gamma",
               "chance_band")

    def rows(self) -> List[dict]:
        """One JSON/CSV row per state t = 0..T (NaN and the missing layer at t = 0 -> None),
        built column by column (10⁶ rows in about a second)."""
        cols = [_column_values(getattr(self, k)) for k in self.COLUMNS]
        layer = cols[self.COLUMNS.index("layer")]
        for t, v in enumerate(layer):
            if v is not None and v < 0:
                layer[t] = None
        return [dict(zip(self.COLUMNS, values)) for values in zip(*cols)]

    @classmethod
    def from_rows(cls, rows: List[dict], n_tokens: int = 0, per_prompt: Optional[dict] = None) -> "StepMeasures":
        """The inverse of :meth:`rows` (and of :meth:`per_prompt`, when given), for results
        read back from JSON (None -> NaN)."""
        get = lambda k, fill, dtype: np.array([fill if r[k] is None else r[k] for r in rows], dtype)
        ints = {"t": get("t", -1, np.int64), "layer": get("layer", -1, np.int64)}
        prompts = {}
        if per_prompt:
            grid = lambda k: np.array([[np.nan if v is None else v for v in row] for row in per_prompt[k]], float)
            prompts = dict(prompt_gamma=grid("gamma"), prompt_rho=grid("rho"),
                           prompt_tokens=np.asarray(per_prompt["n_tokens"], np.int64))
        return cls(**ints, **{k: get(k, np.nan, float) for k in cls.COLUMNS if k not in ints}, n_tokens=n_tokens,
                   **prompts)

    @property
    def n_prompts(self) -> int:
        """B, the prompts whose values are kept (0 when none are)."""
        return 0 if self.prompt_tokens is None else int(len(self.prompt_tokens))

    def standard_error(self, name: str) -> np.ndarray:
        """"float[T+1]": the standard error of ``gamma`` or ``rho`` across prompts, the prompts
        taken as independent clusters of tokens (the tokens of one prompt are not independent).
        For the pooled mean m = sum_b w_b v_b / W (w_b the prompt's valid tokens, W their sum)

            se = sqrt(B / (B - 1) * sum_b w_b^2 (v_b - m)^2) / W,

        the cluster-robust (sandwich) standard error of a ratio estimator; with equal w_b it is
        sd(v_b) / sqrt(B). NaN everywhere with fewer than 2 prompts kept, and where v is NaN."""
        if name not in ("gamma", "rho"):
            raise ValueError(f"standard_error: name must be 'gamma' or 'rho', got {name!r}")
        T1 = len(self.t)
        B = self.n_prompts
        if B < 2:
            return np.full(T1, np.nan)
        v = np.asarray(getattr(self, f"prompt_{name}"), np.float64)          # (B, T+1)
        w = np.asarray(self.prompt_tokens, np.float64)[:, None]
        W = w.sum()
        m = (w * v).sum(0) / W
        return np.sqrt(B / (B - 1) * ((w * (v - m)) ** 2).sum(0)) / W

    def per_prompt(self) -> Optional[dict]:
        """The per-prompt values for JSON: ``n_tokens`` "[B]", ``gamma`` and ``rho`` "[B][T+1]"
        (index t as in :meth:`rows`; NaN -> None), and their standard errors across prompts
        ``gamma_se``, ``rho_se`` "[T+1]" (:meth:`standard_error`); None when not kept."""
        if self.prompt_tokens is None:
            return None
        rows = lambda a: [_column_values(r) for r in np.asarray(a)]
        return {"n_tokens": np.asarray(self.prompt_tokens).tolist(), "gamma": rows(self.prompt_gamma),
                "rho": rows(self.prompt_rho), "gamma_se": _column_values(self.standard_error("gamma")),
                "rho_se": _column_values(self.standard_error("rho"))}


def _column_values(a) -> list:
    """A column as Python numbers: ints stay ints, floats become floats, NaN/inf -> None."""
    a = np.asarray(a)
    if np.issubdtype(a.dtype, np.integer):
        return a.tolist()
    a = a.astype(np.float64)
    values = a.tolist()
    for i in np.flatnonzero(~np.isfinite(a)):
        values[i] = None
    return values


def _per_dim(f, d: int, k: np.ndarray) -> np.ndarray:
    """f(d, j) for every entry j of "int[N]" k, computed once per distinct j."""
    values, inverse = np.unique(k, return_inverse=True)
    return np.array([f(d, int(j)) for j in values], float)[inverse.reshape(-1)]


def prompt_values(traj, subspaces: Subspaces, first: bool = True) -> dict:
    """The per-prompt values of a batch :class:`~powerlens._src.dynamics.simulate.Trajectory` (c
    steps, B prompts) against the principal subspace: ``gamma`` "float[B c]" (the tokens
    leaving each step), ``rho`` "float[B c]", ``n_tokens`` "int[B]" and, with ``first``,
    ``gamma0`` "float[B]" (x_0 against the first step's references)."""
    P = subspaces.index("principal")
    out = {"gamma": np.asarray(traj.gamma, np.float64)[:, :, P], "rho": np.asarray(traj.rho, np.float64)[:, :, P],
           "n_tokens": np.asarray(traj.n_valid, np.int64).reshape(-1)}
    if first:
        out["gamma0"] = np.asarray(traj.gamma_before, np.float64)[:, 0, P]
    return out


def _join_prompts(parts: List[dict]) -> dict:
    """The per-prompt values of consecutive chunks (:func:`prompt_values`) as "[B T+1]" arrays
    (index 0: x_0; rho NaN there)."""
    B = parts[0]["n_tokens"].shape[0]
    gamma = np.concatenate([parts[0]["gamma0"][:, None]] + [p["gamma"] for p in parts], axis=1)
    rho = np.concatenate([np.full((B, 1), np.nan)] + [p["rho"] for p in parts], axis=1)
    return {"gamma": gamma, "rho": rho, "n_tokens": parts[0]["n_tokens"]}


def step_measures(metrics: dict, schedule, subspaces: Subspaces, d: int,
                  prompts: Optional[List[dict]] = None) -> StepMeasures:
    """:class:`StepMeasures` from the pooled metrics of a run (see
    :func:`powerlens._src.dynamics.simulate.pooled`) of ``schedule`` against ``subspaces``;
    ``prompts``: the :func:`prompt_values` of its chunks, to keep each prompt's gamma and rho."""
    m, n_tok = metrics, metrics["n_tokens"]
    P, R, O = (subspaces.index(name) for name in ("principal", "random", "other_layer"))
    state = lambda before, after: np.concatenate([np.atleast_1d(before), after])
    step = lambda a: state(np.nan, a)
    k = np.asarray(subspaces.dim)[np.asarray(schedule)][:, P]            # dim S of each step
    k = state(k[0], k)                                                   # t = 0: the first step's layer
    sd = _per_dim(chance_gamma_std, d, k)
    rho = m["rho"][:, P]
    pvalue = np.where(np.isfinite(rho), binomial_pvalue(m["rho_count"][:, P], n_tok), np.nan)
    return StepMeasures(
        t=np.arange(len(schedule) + 1), layer=state(-1, np.asarray(schedule, np.int64)),
        gamma=state(m["gamma_before"][0, P], m["gamma"][:, P]), rho=step(m["rho"][:, P]),
        rotation=step(m["rotation"]),
        gamma_random=state(m["gamma_before"][0, R], m["gamma"][:, R]), rho_random=step(m["rho"][:, R]),
        gamma_other_layer=state(m["gamma_before"][0, O], m["gamma"][:, O]), rho_other_layer=step(m["rho"][:, O]),
        rho_pvalue=step(np.asarray(pvalue, float)), consensus=m["consensus"], rank_collapse=m["rank_collapse"],
        pairwise_cos=m["pairwise_cos"], chance_gamma=_per_dim(chance_gamma, d, k),
        chance_band=2 * sd / np.sqrt(max(n_tok, 1)), n_tokens=n_tok,
        **({} if not prompts else {f"prompt_{k}" if k != "n_tokens" else "prompt_tokens": v
                                   for k, v in _join_prompts(prompts).items()}))


@dataclasses.dataclass
class RunResult:
    """A measured run: spectra, the references used, the schedule, the pooled measures and,
    when kept, the states "float[T+1 B n d]"."""

    spectra: List[LayerSpectrum]
    subspaces: Subspaces
    schedule: Schedule
    order: str
    measures: StepMeasures
    states: Optional[np.ndarray]
    d: int

    @property
    def steps(self) -> int:
        return len(self.schedule)


AXES = ("layers", "steps")


def measure_axis(ref: StepMeasures, over: str):
    """(x values "int[T]", x label) of the T steps of a run drawn ``over`` layers or steps:
    ``layers`` numbers the layers from 0 (state t leaves layer t - 1, the (t-1)-th layer the
    schedule applies), ``steps`` counts the steps done, 1 .. T."""
    if over not in AXES:
        raise ValueError(f"over must be one of {AXES}, got {over!r}")
    t = np.asarray(ref.t)[1:]
    return (t - 1, "layer") if over == "layers" else (t, "step t")


def plot_measures(measures: Dict[str, StepMeasures], path: str, *, over: str, title: Optional[str] = None,
                  other_layer_gamma: bool = False, marks=None, return_fig: bool = False):
    """gamma_t and rho_t (t >= 1) of one run per ordering (``measures``: order -> StepMeasures),
    with the chance band and the controls of the first ordering: the random subspace for
    gamma (and the other layer with ``other_layer_gamma``), both controls for rho (a control
    undefined everywhere, as the other layer of a one-layer model, is left out). Where each
    prompt's values are kept (2 prompts or more), gamma_t and rho_t get a band of ±1 standard
    error across prompts (:meth:`StepMeasures.standard_error`).
    ``over``: ``layers`` (x = the layer, numbered from 0) or ``steps`` (x = the step, 1 .. T);
    see :func:`measure_axis`. ``marks``: label -> x values (layers, or steps) to shade
    (see :func:`powerlens._src.analysis.plots.plot_alignment`). Returns ``path`` (the figure with
    ``return_fig``)."""
    from . import plots
    ref = next(iter(measures.values()))
    x, xlabel = measure_axis(ref, over)
    step = lambda a: np.asarray(a)[1:]
    gamma_controls = {"random subspace": step(ref.gamma_random)}
    if other_layer_gamma:
        gamma_controls["other layer"] = step(ref.gamma_other_layer)
    return plots.plot_alignment(
        x, {o: step(m.gamma) for o, m in measures.items()}, {o: step(m.rho) for o, m in measures.items()},
        path, chance=step(ref.chance_gamma), chance_band=step(ref.chance_band), gamma_controls=gamma_controls,
        rho_controls={"random subspace": step(ref.rho_random), "other layer": step(ref.rho_other_layer)},
        xlabel=xlabel, title=title, marks=marks, return_fig=return_fig,
        gamma_err={o: step(m.standard_error("gamma")) for o, m in measures.items() if m.n_prompts >= 2},
        rho_err={o: step(m.standard_error("rho")) for o, m in measures.items() if m.n_prompts >= 2},
        err_label=f"±1 s.e. across {ref.n_prompts} prompts")


def rows_csv(rows: List[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0].keys()))
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if v is None else v) for k, v in r.items()})
    return buf.getvalue()


class NonFiniteStateError(ValueError, FloatingPointError):
    """A state, or a measure of a finite state, became non-finite (inf or NaN) at ``step``
    (1-based: the step whose output is bad) of ``steps``; nothing of the run is reported.
    :meth:`with_hint` adds what the caller can do about it (a command knows its flags)."""

    def __init__(self, step: int, steps: int, rule: str, dtype, *, state: bool = True, hint: str = ""):
        self.step, self.steps, self.rule, self.dtype, self.state, self.hint = step, steps, rule, dtype, state, hint
        where = f"at step {step} of {steps} (rule {rule}, {np.dtype(dtype).name})"
        what = (f"the state became non-finite {where}: a token overflowed to inf or NaN, or collapsed to 0"
                if state else f"a measure became non-finite {where} although the state is finite")
        super().__init__(what + (f"; {hint}" if hint else ""))

    def with_hint(self, hint: str) -> "NonFiniteStateError":
        return NonFiniteStateError(self.step, self.steps, self.rule, self.dtype, state=self.state, hint=hint)


def first_non_finite(part: dict, defined: np.ndarray):
    """(index, is the state itself bad) of the first bad state of one chunk's pooled metrics
    (index 0 is the state the chunk started from), or None.

    A state is bad when a valid token is non-finite or zero, or when a measure of it that is defined
    (``defined`` "bool[c m]": the references of each step's layer with dim > 0) is not finite.
    """
    state_ok = np.asarray(part["finite"], bool)                                        # (c+1,)
    measure_ok = np.isfinite(part["consensus"]) & np.isfinite(part["rank_collapse"]) & np.isfinite(part["pairwise_cos"])
    gamma_ok = lambda key: np.all(np.isfinite(part[key]) | ~defined, axis=1)         # (c,)
    after = gamma_ok("gamma") & gamma_ok("rho")
    ok = state_ok & measure_ok & np.concatenate([[True], after]) & np.append(gamma_ok("gamma_before"), True)
    bad = np.flatnonzero(~ok)
    return None if bad.size == 0 else (int(bad[0]), bool(not state_ok[bad[0]]))


def chunk_steps(T: int) -> int:
    """Steps per chunk of a run of T steps: 100, growing with T to 10⁴ (about 100 chunks),
    so that the progress bar moves, an interrupt is taken between chunks and per-chunk
    overheads stay small against the steps."""
    return int(min(T, min(max(100, -(-T // 100)), 10_000)))


def _join(parts: List[dict]) -> dict:
    """The pooled metrics of consecutive chunks as one run (a state measure's first entry of
    every chunk after the first repeats the previous chunk's last state)."""
    per_state = ("consensus", "rank_collapse", "pairwise_cos", "finite")
    return {k: parts[0][k] if k == "n_tokens" else
            np.concatenate([parts[0][k]] + [p[k][1:] for p in parts[1:]]) if k in per_state else
            np.concatenate([p[k] for p in parts]) for k in parts[0]}


def run_system(layers: Layers, X0, valid=None, *, dynamics: Optional[Dynamics] = None,
               order: str = "shifted", seed: int = 0, rule: Optional[str] = None, attention: Optional[str] = None,
               keep_bias: Optional[bool] = None, save_states: bool = False, keep_states_limit: int = 4_000_000,
               chunk: Optional[int] = None,
               progress: bool = True, desc: str = "simulate", spectra: Optional[List[LayerSpectrum]] = None,
               positions=None, per_prompt: bool = False) -> RunResult:
    """Spectra, reference subspaces and the measured simulation of ``layers`` from X0.

    States are kept when ``save_states`` or when they are small (<= keep_states_limit
    numbers), for plotting trajectories. ``chunk``: steps per jitted call (default
    :func:`chunk_steps`). ``per_prompt``: also keep each prompt's gamma_t and rho_t
    (O(B T) numbers; :class:`StepMeasures`' ``prompt_*``). Raises :class:`NonFiniteStateError`
    at the first non-finite state or measure. ``dynamics``: a
    :class:`~powerlens._src.dynamics.options.Dynamics` (default ``Dynamics()``, the paper's rule);
    ``rule``, ``attention``, ``keep_bias``: deprecated, its fields as loose keywords.
    """
    if "ipykernel" in sys.modules:      # a notebook's widget bar
        from tqdm.auto import tqdm
    else:                               # tqdm.auto would import asyncio (about 0.05 s) for nothing
        from tqdm import tqdm

    dyn = as_dynamics(dynamics, rule, attention, keep_bias, where="run_system").resolved(layers.config)
    check_order(order)
    X0 = check_tokens(X0, layers.config.d_model, valid=valid)
    if X0.ndim == 2:
        X0 = X0[None]
    if spectra is None:
        spectra = spectra_of(layers)
    subs = reference_subspaces(spectra, order=order, seed=seed, dtype=layers.dtype)
    schedule = layers.schedule
    T = len(schedule)
    chunk = chunk_steps(T) if chunk is None else int(chunk)
    dims = np.asarray(subs.dim) > 0                                                   # (U, m)
    keep = save_states or (T + 1) * X0.size <= keep_states_limit
    parts, states, prompts = [], [np.asarray(X0)[None]] if keep else None, []
    X = X0
    with tqdm(total=T, desc=desc, disable=not progress, leave=False) as bar:
        for start in range(0, T, chunk):
            sched = schedule.array(start, start + chunk)
            traj = simulate_batch(layers, X, subs, valid=valid, dynamics=dyn, save_states=keep, schedule=sched,
                                  positions=positions, check_finite=False)   # checked here: the step of the whole run
            part = pooled(traj)
            bad = first_non_finite(part, dims[sched])
            if bad is not None:
                raise NonFiniteStateError(start + bad[0], T, dyn.rule, layers.W_v.dtype, state=bad[1])
            parts.append(part)
            if per_prompt:
                prompts.append(prompt_values(traj, subs, first=start == 0))
            if keep:
                states.append(np.swapaxes(np.asarray(traj.states), 0, 1)[1:])
            X = np.asarray(traj.final)
            bar.update(len(sched))
    metrics = _join(parts)
    d = layers.config.d_model
    return RunResult(spectra=spectra, subspaces=subs, schedule=schedule, order=order,
                     measures=step_measures(metrics, schedule, subs, d, prompts),
                     states=np.concatenate(states) if keep else None, d=d)
