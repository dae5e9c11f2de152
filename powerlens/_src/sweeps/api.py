"""``sweep(spec, out)`` and ``load_sweep(out)``: a sweep as a pandas DataFrame.

    df = pl.sweep("my_first_sweep.toml", out="runs/first")   # resumable folder
    df = pl.sweep({"grid": {"heads": [1, 2]}, ...})           # in memory, nothing written
    df = pl.load_sweep("runs/first")
    one = pl.sweep_system("runs/first", 17)                   # row 17's system, rebuilt

The output folder (``out``) holds, once the sweep has finished::

    results.parquet, results.csv   one row per system (series columns: parquet only)
    sweep.json                     spec, versions, devices, processes, timing, non_finite (rows
                                   whose run went non-finite: their measures are null)
    figures/*.png, report.html     see :mod:`powerlens._src.sweeps.report`
    .chunks/*.json                 the finished chunks (kept: a finished sweep reloads at once)

With several processes (:mod:`powerlens._src.runtime.distributed`) every process calls
``sweep`` with the same spec and folder: process 0 checks, locks and marks the folder,
the others wait for it; each computes its chunks; process 0 merges and writes after a
barrier and returns the table (the others return None).
"""
from __future__ import annotations

import contextlib
import dataclasses
import io as _bytes
import json
import os
import time
from typing import Any, Callable, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import io
from ..dynamics.options import Dynamics
from ..dynamics.subspaces import Subspaces
from .columns import series_column
from .engine import Engine, SweepResult, barrier, program_static, shared_input, static_of
from .grid import DYNAMIC, Grid, system_seeds
from .provenance import folder_spec, sweep_record
from .spec import Spec, load_spec
from .store import ChunkFolder, MemoryStore, check_folder, prepare_folder
from .systems import synthetic_builder

RESULTS = "results.parquet"


def sweep(spec, out: str | os.PathLike | None = None, *, overwrite: bool = False, plot: Optional[str] = None,
          progress: bool = True, report_files: bool = True, mode: str = "local",
          announce: Optional[Callable[[str], None]] = None):
    """Run (or resume) a sweep and return its table (a pandas DataFrame; None on processes > 0).

    Args:
      spec: a TOML path, a dict of tables, or a :class:`~powerlens._src.sweeps.spec.Spec`.
      out: the output folder (None: run in memory, write nothing).
      overwrite: replace a folder powerlens wrote with another spec or by another command (one
        holding anything powerlens did not write is refused either way).
      plot: the heatmap ``MEASURE:X:Y`` (default final_gamma over the first two grid axes).
      progress: show a progress bar (systems per second).
      report_files: write figures and report.html (results and sweep.json always).
      mode: ``"local"`` (each process runs its own chunks) or ``"global"`` (every chunk is
        sharded over all processes' devices).
      announce: called with one line saying what will run (systems, chunks, memory per
        chunk) once everything is checked, before anything is compiled.

    Everything that can be checked is checked before ``out`` is touched (the spec, the plan
    and its memory, a model sweep's model, layers and prompts, a custom builder's first
    point): a refused sweep creates no folder. A model sweep's folder records the
    checkpoint's identity (:func:`~powerlens._src.sweeps.provenance.checkpoint_identity`): a changed
    checkpoint at the same path is refused like a changed spec.
    """
    from . import report               # matplotlib: loaded only when a sweep is run through here
    spec = spec if isinstance(spec, Spec) else load_spec(spec)
    report.parse_plot(plot, spec)
    if out is None and jax.process_count() > 1:
        raise ValueError("a sweep over several processes needs an output folder (out=...) that all of them see")
    target = None if out is None else io.check_out_path(out, command="sweep")
    engine = Engine(spec, mode=mode, progress=progress)          # every check: nothing is written before
    if announce is not None and jax.process_index() == 0:
        announce(engine.describe())
    if out is None:
        return engine.run(MemoryStore()).table
    spec_dict = folder_spec(spec, engine.checkpoint)
    rank = jax.process_index()
    t0 = time.time()
    with io.folder_lock(target) if rank == 0 else contextlib.nullcontext():
        if rank == 0:                         # the others look only once process 0 has marked the folder
            action = check_folder(target, spec_dict, overwrite)
            if action != "resume":
                prepare_folder(target, spec_dict, action)
        barrier("powerlens-sweep-start")
        if rank != 0:
            check_folder(target, spec_dict, overwrite=False)
        result = engine.run(ChunkFolder(target))
        if rank == 0:
            write_outputs(target, spec, result, plot=plot, report_files=report_files, started=t0)
    return result.table


def write_outputs(target: str, spec: Spec, result: SweepResult, *, plot=None, report_files=True,
                  started: float = None) -> list:
    """results.parquet, results.csv, sweep.json (and the figures and report.html)."""
    from . import report
    df = result.table
    buf = _bytes.BytesIO()
    df.to_parquet(buf, index=False, engine="pyarrow")
    written = [io.write_bytes(os.path.join(target, RESULTS), buf.getvalue())]
    flat = df.drop(columns=[c for c in map(series_column, spec.measure["series"]) if c in df])
    written.append(io.write_text(os.path.join(target, "results.csv"), flat.to_csv(index=False)))
    info = sweep_record(spec, result, len(df), started)
    if report_files:
        figures = report.write_figures(target, df, spec, plot)
        written += [os.path.join(target, f) for f in figures]
        info["figures"] = figures
        written.append(io.write_text(os.path.join(target, "report.html"),
                                     report.render_html(target, df, spec, info, figures)))
    written.append(io.write_json(os.path.join(target, "sweep.json"), info))
    return written


def load_sweep(out: str | os.PathLike):
    """The table of a finished sweep folder (results.parquet) as a pandas DataFrame."""
    import pandas as pd
    path = os.path.join(os.fspath(out), RESULTS)
    if not os.path.isfile(path):
        raise ValueError(f"{out}: no {RESULTS} (not a finished powerlens sweep folder)")
    return pd.read_parquet(path, engine="pyarrow")


# ------------------------------------------------------------------ one row, rebuilt

@dataclasses.dataclass(frozen=True)
class SweepSystem:
    """One sweep row's system, rebuilt from its seed and grid values.

    Attributes:
      layers: the one-layer :class:`~powerlens._src.dynamics.params.Layers`, schedule ``repeat(0, T)``.
      x0: "float[n d]" initial tokens; valid: "bool[n]".
      subspaces: the references the row's alignment columns were measured against
        ("float[1 m d k]": principal, random, other_layer).
      facts: the spectral facts: ``lam`` "float[3 2]" (lambda_1..3 in the shifted order, the
        row's ``lambda*`` columns), ``dim`` (``principal_dim``), ``direction``, ``top2``, ``v1``,
        ``x0_exact``; a synthetic row adds everything
        :func:`powerlens._src.dynamics.synthetic.synthetic` returns (the spectrum in both orders).
      rule, attention, keep_bias, x64: how the row was run: ``with jax.enable_x64(s.x64):
        pl.run(s.layers, s.x0, s.valid, dynamics=s.dynamics, observers=...)`` (a float64 row run
        without x64 is run in float32, to float32's rounding).
    """

    layers: Any
    x0: np.ndarray
    valid: np.ndarray
    subspaces: Subspaces
    facts: Dict[str, Any]
    rule: str
    attention: str
    keep_bias: Optional[bool]
    x64: bool = False

    @property
    def dynamics(self) -> Dynamics:
        """``rule``, ``attention`` and ``keep_bias`` as the one value ``pl.run`` takes."""
        return Dynamics(self.rule, self.attention, self.keep_bias)


def _spec_and_rows(source):
    """(Spec, table or None) of a finished sweep folder, or of a spec (path, dict, Spec)."""
    if isinstance(source, Spec):
        return source, None
    if isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
        path = os.path.join(os.fspath(source), "sweep.json")
        if not os.path.isfile(path):
            raise ValueError(f"{source}: no sweep.json (not a finished powerlens sweep folder)")
        with open(path) as fh:
            info = json.load(fh)
        return load_spec(info["spec"]), load_sweep(source)
    return load_spec(source), None


def _row_value(row, key: str, spec: Spec, grid: Grid):
    """A key's value for a row: its grid column (a JSON list for a range), else the spec's."""
    if key in grid.axes:
        v = row[key]
        return json.loads(v) if isinstance(v, str) and v.startswith("[") else v
    return spec.value(key)


def _system_of(row, spec: Spec, grid: Grid) -> int:
    """The global system id of a row, checked: its seed and grid values are this sweep's."""
    try:
        point, rep, seed = int(row["point"]), int(row["replicate"]), int(row["seed"])
    except (KeyError, TypeError, ValueError):
        raise ValueError("sweep_system: the row needs its 'point', 'replicate' and 'seed' columns") from None
    if not (0 <= point < grid.n_points and 0 <= rep < grid.replicates):
        raise ValueError(f"sweep_system: row (point {point}, replicate {rep}) is not in this sweep "
                         f"({grid.n_points} points x {grid.replicates} replicates)")
    if int(system_seeds(spec.seed, [point], [rep])[0]) != seed:
        raise ValueError(f"sweep_system: row (point {point}, replicate {rep}) has seed {seed}, not this sweep's")
    cols = grid.columns([point * grid.replicates + rep])
    for key in grid.axes:
        if key in row and row[key] != cols[key][0]:
            raise ValueError(f"sweep_system: row (point {point}) has {key} = {row[key]!r}; this sweep's "
                             f"point {point} has {cols[key][0]!r}")
    return point * grid.replicates + rep


def sweep_system(out_dir_or_spec, row) -> SweepSystem:
    """The system of one sweep row, rebuilt from its ``seed`` and grid values alone.

    Args:
      out_dir_or_spec: a finished sweep folder (its ``sweep.json`` names the spec), or the spec
        itself (a TOML path, a dict of tables, a :class:`~powerlens._src.sweeps.spec.Spec`).
      row: a row of the sweep's table (a pandas Series or a dict with its ``point``,
        ``replicate``, ``seed`` and grid columns), or, with a folder, a row number of its table.

    Returns:
      A :class:`SweepSystem`: its ``facts["lam"]`` are the row's ``lambda1_*``/``lambda2_*``
      columns, and running it (``pl.run`` with the alignment and consensus observers against
      ``subspaces``) gives the row's measured columns. A synthetic row is built by
      :func:`powerlens._src.dynamics.synthetic.synthetic` from its seed, as the sweep built it; a
      ``[model]`` or custom-builder row by the sweep's host builder for its point.
    """
    spec, table = _spec_and_rows(out_dir_or_spec)
    if isinstance(row, (int, np.integer)) and not isinstance(row, bool):
        if table is None:
            raise ValueError("sweep_system: a row number needs a finished sweep folder; pass the row itself")
        if not 0 <= int(row) < len(table):
            raise ValueError(f"sweep_system: row {int(row)} does not exist ({len(table)} rows)")
        row = table.iloc[int(row)]
    grid = Grid(spec)
    system = _system_of(row, spec, grid)
    point = system // grid.replicates
    group = next(g for g in grid.groups() if g.contains([point])[0])
    st = static_of(spec, group)
    how = {"rule": st.rule, "attention": st.attention, "keep_bias": st.keep_bias or None, "x64": st.x64}
    builder = spec.system.get("builder", "synthetic")
    with jax.enable_x64(st.x64):
        if spec.model is None and builder == "synthetic":       # the engine's builder, one system
            dt = np.float64 if st.x64 else np.float32
            values = {k: np.asarray(_row_value(row, k, spec, grid), dt)[None] for k in DYNAMIC}
            build = synthetic_builder(program_static(st, True).synthetic)
            sy, facts = jax.device_get(build(shared_input(st, True), np.array([row["seed"]], np.int32), values))
            sy, facts = jax.tree_util.tree_map(lambda a: a[0], (sy, facts))
            facts.pop("x0")
            return SweepSystem(layers=sy.layers, x0=sy.x0, valid=np.ones(sy.x0.shape[0], bool),
                               subspaces=jax.tree_util.tree_map(jnp.asarray, sy.subspaces), facts=facts, **how)
        sy = Engine(spec, progress=False).systems_of([system])
    one = jax.tree_util.tree_map(lambda a: a[0], sy)
    facts = {"lam": np.asarray(one.lam), "dim": np.asarray(one.dim), "direction": one.direction,
             "top2": one.top2, "v1": np.asarray(one.v1), "x0_exact": one.x0_exact}
    return SweepSystem(layers=one.layers, x0=np.asarray(one.x0), valid=np.asarray(one.valid, bool),
                       subspaces=jax.tree_util.tree_map(jnp.asarray, one.subspaces), facts=facts, **how)
