"""``powerlens sweep``: a researcher's own parameter sweep, from one CPU to many devices and hosts.

    spec      the TOML spec: reading, validation, defaults
    grid      points, their systems and seeds, groups of equal static shape
    systems   what a row is computed from (synthetic on the device, models, custom builders)
    measures  the one run of each system (observers) inside the compiled program
    columns   the table's columns, reduced on the host
    engine    chunks, jit(shard_map(lax.map(vmap))), progress, resumption
    store     finished chunks on disk; the output folder's rules
    report    figures and report.html
    api       sweep(spec, out) -> DataFrame, load_sweep(out)

This package sits on top (beside reproduce and commands): it may import dynamics, models,
analysis, steering and io. Starting several processes (``jax.distributed``, local workers)
is the command line's business: :mod:`powerlens.runtime.distributed`.
"""
from .api import load_sweep, sweep
from .spec import Spec, load_spec

__all__ = ["sweep", "load_sweep", "load_spec", "Spec"]
