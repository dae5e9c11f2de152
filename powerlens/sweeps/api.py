"""``sweep(spec, out)`` and ``load_sweep(out)``: a sweep as a pandas DataFrame.

    df = pl.sweep("my_first_sweep.toml", out="runs/first")   # resumable folder
    df = pl.sweep({"grid": {"heads": [1, 2]}, ...})           # in memory, nothing written
    df = pl.load_sweep("runs/first")

The output folder (``out``) holds, once the sweep has finished::

    results.parquet, results.csv   one row per system (series columns: parquet only)
    sweep.json                     spec, versions, devices, processes, timing, non_finite (rows
                                   whose run went non-finite: their measures are null)
    figures/*.png, report.html     see :mod:`powerlens.sweeps.report`
    .chunks/*.json                 the finished chunks (kept: a finished sweep reloads at once)

With several processes (:mod:`powerlens.sweeps.distributed`) every process calls
``sweep`` with the same spec and folder: process 0 checks, locks and marks the folder,
the others wait for it; each computes its chunks; process 0 merges and writes after a
barrier and returns the table (the others return None).
"""
from __future__ import annotations

import contextlib
import io as _bytes
import os
import time
from typing import Callable, Optional

import jax

from .. import io
from .engine import Engine, SweepResult, barrier
from .spec import Spec, load_spec
from .store import ChunkFolder, MemoryStore, check_folder, prepare_folder
from .systems import checkpoint_identity

RESULTS = "results.parquet"


def sweep(spec, out: Optional[str] = None, *, overwrite: bool = False, plot: Optional[str] = None,
          progress: bool = True, report_files: bool = True, mode: str = "local",
          announce: Optional[Callable[[str], None]] = None):
    """Run (or resume) a sweep and return its table (a pandas DataFrame; None on processes > 0).

    Args:
      spec: a TOML path, a dict of tables, or a :class:`~powerlens.sweeps.spec.Spec`.
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
    checkpoint's identity (:func:`~powerlens.sweeps.systems.checkpoint_identity`): a changed
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


def folder_spec(spec: Spec, checkpoint: Optional[dict] = None) -> dict:
    """What the folder's marker records of a sweep: the normalised spec, and for a model sweep
    the checkpoint's identity (``checkpoint``, else read now; a resume refuses a changed one,
    naming its files)."""
    out = spec.to_dict()
    if spec.model is not None:
        out["checkpoint"] = checkpoint if checkpoint is not None else checkpoint_identity(spec.model["name"])
    return out


def write_outputs(target: str, spec: Spec, result: SweepResult, *, plot=None, report_files=True,
                  started: float = None) -> list:
    """results.parquet, results.csv, sweep.json (and the figures and report.html)."""
    from . import report
    df = result.table
    buf = _bytes.BytesIO()
    df.to_parquet(buf, index=False, engine="pyarrow")
    written = [io.write_bytes(os.path.join(target, RESULTS), buf.getvalue())]
    flat = df.drop(columns=[c for c in spec.measure["series"] if c in df])
    written.append(io.write_text(os.path.join(target, "results.csv"), flat.to_csv(index=False)))
    info = {"spec": spec.to_dict(), "versions": io.versions(), "devices": result.devices,
            "processes": result.processes, "systems": int(len(df)), "chunks": result.chunks,
            "chunks_computed": result.computed, "chunks_resumed": result.resumed,
            "chunks_recomputed": result.recomputed, "non_finite": result.non_finite, "groups": result.groups,
            "timing": {"seconds": round(time.time() - (started or time.time()), 3),
                       "compute_seconds": round(result.compute_seconds, 3),
                       "systems_computed": result.systems_computed,
                       "systems_per_second": (round(result.systems_computed / result.compute_seconds, 2)
                                              if result.compute_seconds > 0 else None)}}
    if report_files:
        figures = report.write_figures(target, df, spec, plot)
        written += [os.path.join(target, f) for f in figures]
        info["figures"] = figures
        written.append(io.write_text(os.path.join(target, "report.html"),
                                     report.render_html(target, df, spec, info, figures)))
    written.append(io.write_json(os.path.join(target, "sweep.json"), info))
    return written


def load_sweep(out: str):
    """The table of a finished sweep folder (results.parquet) as a pandas DataFrame."""
    import pandas as pd
    path = os.path.join(os.fspath(out), RESULTS)
    if not os.path.isfile(path):
        raise ValueError(f"{out}: no {RESULTS} (not a finished powerlens sweep folder)")
    return pd.read_parquet(path, engine="pyarrow")
