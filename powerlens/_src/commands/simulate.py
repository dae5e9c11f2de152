"""``powerlens simulate`` and ``powerlens spectrum --weights``."""
from __future__ import annotations

import os

from .. import io
from ..analysis.experiment import NonFiniteStateError, plot_measures, rows_csv, run_system
from ..analysis.spectra import spectra_json, spectra_of
from ..dynamics.options import Dynamics
from . import budget
from .system import build_system, initial_tokens, token_shape


SYNTHETIC_OPTIONS = ("kind", "dim", "heads", "beta")
"""Options of a synthetic system (``--spectrum``): they apply to nothing else."""


def settings_of(args) -> dict:
    """The options that applied to a run, for its JSON: what was left unset (None) is left out,
    and so are the synthetic system's options (kind, dim, heads, beta) unless ``--spectrum``
    built it, and ``--norm`` under the paper rule (always L2)."""
    skip = {"func", "command"}
    if not getattr(args, "spectrum", None):
        skip.update(SYNTHETIC_OPTIONS)
    if getattr(args, "rule", None) in (None, "paper"):
        skip.add("norm")
    return {k: v for k, v in vars(args).items() if k not in skip and v is not None}


def write_run_figures(stage: str, res, *, title: str = "") -> list:
    """eigenvalues.png, alignment.png, consensus.png and trajectories.png of a run."""
    from ..analysis import plots
    m = res.measures
    files = [plots.plot_eigenvalues(res.spectra, os.path.join(stage, "eigenvalues.png"), title=title or None)]
    files.append(plot_measures({res.order: m}, os.path.join(stage, "alignment.png"), over="steps",
                               title=title or None, other_layer_gamma=True))
    files.append(plots.plot_consensus(
        m.consensus, os.path.join(stage, "consensus.png"), rank_collapse=m.rank_collapse,
        pairwise_cos=m.pairwise_cos, title=title or None))
    if res.states is not None:
        u = res.schedule[-1]
        plane = res.spectra[u].get(res.order).plane
        files.append(plots.plot_trajectories(res.states[:, 0], plane, os.path.join(stage, "trajectories.png"),
                                             title=title or None))
    return files


def non_finite_hint(args) -> str:
    """What to try when a state overflows: float64, unless the run was float64 already."""
    return "try smaller weights" if getattr(args, "x64", False) else "try --x64 or smaller weights"


def cmd_simulate(args) -> int:
    layers = build_system(args)
    d = layers.config.d_model
    B, n = token_shape(args, d)
    budget.check(budget.run_estimate(**budget.shapes_of(layers), steps=len(layers.schedule), batch=B, tokens=n,
                                     save_states=args.save_states))
    x0 = initial_tokens(args, d)
    try:
        res = run_system(layers, x0, dynamics=Dynamics(rule=args.rule, attention=args.attention,
                                                       keep_bias=args.keep_bias or None),
                         order=args.order, seed=args.seed, save_states=args.save_states, progress=not args.quiet)
    except NonFiniteStateError as exc:
        raise exc.with_hint(non_finite_hint(args)) from None
    rows = res.measures.rows()
    doc = {"settings": {**settings_of(args), "versions": io.versions()}, "steps": rows,
           "layers": spectra_json(res.spectra)}
    with io.output_dir(args.out, command=args.command) as stage:
        io.write_json(os.path.join(stage, "metrics.json"), doc)
        io.write_text(os.path.join(stage, "metrics.csv"), rows_csv(rows))
        if args.save_states:
            states = res.states if x0.ndim == 3 else res.states[:, 0]
            io.save_npy(os.path.join(stage, "states.npy"), states)
        figs = write_run_figures(stage, res)
    last = rows[-1]
    print(f"wrote {args.out}: metrics.json, metrics.csv, {len(figs)} figures"
          + (", states.npy" if args.save_states else ""))
    print(f"T={res.steps}  final gamma={_fmt(last['gamma'])}  distance to consensus={_fmt(last['consensus'])}  "
          f"top eigenvalue (shifted)={res.spectra[-1].shifted.top:.4g}")
    return 0


def _fmt(v):
    return "n/a" if v is None else f"{v:.4g}"


def cmd_spectrum_weights(args) -> int:
    layers = build_system(args)
    budget.check(budget.spectra_estimate(layers.n_unique, layers.config.d_model))
    spectra = spectra_of(layers)
    doc = {"settings": {**settings_of(args), "versions": io.versions()}, "layers": spectra_json(spectra)}
    from ..analysis import plots
    with io.output_dir(args.out, command=args.command) as stage:
        io.write_json(os.path.join(stage, "spectrum.json"), doc)
        plots.plot_eigenvalues(spectra, os.path.join(stage, "eigenvalues.png"))
    differ = [s.layer for s in spectra if s.orderings_differ]
    print(f"wrote {args.out}: spectrum.json, eigenvalues.png ({len(spectra)} layers; orderings differ at {differ})")
    return 0
