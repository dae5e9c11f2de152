"""``powerlens sweep``: a researcher's own parameter sweep, from one CPU to many devices and hosts.

    spec -> plan -> engine -> store -> report

    schema      the kinds of key of a spec, their bounds and messages (plain Python)
    spec        the TOML spec: its tables, defaults and the checks across keys
    grid        points, their systems and seeds, groups of equal static shape
    plan        the memory of a chunk, chunk sizes, refusals (plain Python, no JAX)
    systems     what a row is computed from (synthetic on the device, models, custom builders)
    measures    the one run of each system (observers) inside the compiled program
    columns     the table's columns, reduced on the host
    engine      launch and finish: jit(shard_map(lax.map(vmap))), the pipelined loop, progress
    store       finished chunks on disk; the output folder's rules
    provenance  what a stored chunk was computed from (spec hash, checkpoint, checksums), sweep.json
    report      figures and report.html
    api         sweep(spec, out) -> DataFrame, load_sweep(out), sweep_system(out, row)

This package sits on top (beside reproduce and commands): it may import dynamics, models,
analysis, steering and io. Starting several processes (``jax.distributed``, local workers)
is the command line's business: :mod:`powerlens._src.runtime.distributed`. Names are resolved on
first use (PEP 562), so importing one module (``powerlens._src.sweeps.plan``) loads only what it needs.
"""
from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS = {name: (f"{__name__}.{module}", name) for name, module in (
    ("sweep", "api"), ("load_sweep", "api"), ("load_spec", "spec"), ("Spec", "spec"))}

__all__ = ["sweep", "load_sweep", "load_spec", "Spec"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
