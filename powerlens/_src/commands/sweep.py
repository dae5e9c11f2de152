"""``powerlens sweep SPEC.toml --out DIR``: a parameter sweep of your own.

    powerlens sweep SPEC --out DIR [--overwrite] [--plot M:X:Y] [--quiet]
    powerlens sweep SPEC --out DIR --processes N                       # N local workers
    powerlens sweep SPEC --out DIR --coordinator HOST:PORT --num-processes N --process-id I
                                  [--init-timeout S] [--global-mesh]

Under Slurm or Open MPI (or with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID set) the distributed settings come from the environment.
"""
from __future__ import annotations

import argparse
import os


def add_sweep_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``powerlens sweep`` on the CLI's sub-parsers."""
    p = subparsers.add_parser("sweep", help="a parameter sweep from a TOML spec, on every local device, "
                                            "or over several processes and hosts")
    p.add_argument("spec", help="the sweep spec (TOML): [grid], [system] or [model], [run], [measure]")
    p.add_argument("--out", required=True, help="output folder; a sweep with the same spec resumes into it")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in a folder written with another spec or by another command "
                        "(a folder holding files powerlens did not write is never emptied)")
    p.add_argument("--plot", metavar="M:X:Y",
                   help="heatmap of measure M over grid axes X and Y (default final_gamma over the first two)")
    p.add_argument("--processes", type=int, default=1, help="start N local worker processes (127.0.0.1)")
    p.add_argument("--coordinator", metavar="HOST:PORT", help="the coordinator of a multi-process sweep "
                                                              "(served by process 0)")
    p.add_argument("--num-processes", type=int, help="with --coordinator: how many processes take part")
    p.add_argument("--process-id", type=int, help="with --coordinator: this process's index, 0 .. N-1")
    p.add_argument("--init-timeout", type=float, default=60.0,
                   help="seconds to wait for the coordinator and the other processes, at most 86400 "
                        "(default 60)")
    p.add_argument("--global-mesh", action="store_true",
                   help="shard every chunk over all processes' devices (default: each process runs its own chunks)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_sweep)
    return p


def _forwarded(args) -> list:
    """The options a spawned worker gets (all but --processes and the distributed ones)."""
    argv = [args.spec, "--out", args.out, "--init-timeout", str(args.init_timeout)]
    argv += ["--overwrite"] * args.overwrite + ["--global-mesh"] * args.global_mesh + ["--quiet"] * args.quiet
    if args.plot:
        argv += ["--plot", args.plot]
    return argv


def cmd_sweep(args) -> int:
    from .. import io
    from ..runtime import distributed, threads, workers
    from ..sweeps.report import parse_plot
    from ..sweeps.spec import load_spec
    from ..sweeps.api import folder_spec
    from ..sweeps.store import check_folder
    workers.bind_to_parent_from_env()              # a worker of `--processes N`: it ends with its launcher
    if args.processes < 1:
        raise ValueError(f"--processes must be a positive integer, got {args.processes}")
    distributed.check_init_timeout(args.init_timeout)          # nan or inf would wait for ever
    spec = load_spec(args.spec)
    parse_plot(args.plot, spec)
    target = io.check_out_path(args.out, command="sweep")
    if args.processes > 1:
        if args.coordinator:
            raise ValueError("--processes starts its own workers; it cannot be combined with --coordinator")
        check_folder(target, folder_spec(spec), args.overwrite)   # refused before any worker starts
        return workers.spawn(_forwarded(args), args.processes)
    # before anything starts the backend: the numbers then do not depend on the process count
    from ..dynamics.execution import backends_initialized
    if not backends_initialized():                  # too late in a process whose JAX has started
        env = dict(os.environ)
        if threads.same_numbers_xla(env):
            os.environ["XLA_FLAGS"] = env["XLA_FLAGS"]
    multi = distributed.initialize(args.coordinator, args.num_processes, args.process_id, timeout=args.init_timeout)
    if multi:
        threads.start_xla()                         # after jax.distributed: one thread when worker_env asked
    import jax
    from ..sweeps.api import sweep
    rank = jax.process_index()
    df = sweep(spec, target, overwrite=args.overwrite, plot=args.plot, progress=not args.quiet and rank == 0,
               mode="global" if args.global_mesh else "local",
               announce=lambda plan: print(f"powerlens sweep: {plan}", flush=True))
    if rank:
        print(f"powerlens sweep: process {rank} of {jax.process_count()} done")
        return 0
    import json
    with open(os.path.join(target, "sweep.json"), encoding="utf-8") as fh:
        info = json.load(fh)
    t = info["timing"]
    rate = f", {t['systems_per_second']:.1f} systems/s" if t["systems_per_second"] else ""
    bad = info["non_finite"]
    print(f"powerlens sweep: {len(df)} systems ({info['chunks_computed']} chunks computed, "
          f"{info['chunks_resumed']} resumed{rate}" + (f", {jax.process_count()} processes" if multi else "")
          + f"); {bad} non-finite" + (" (their measures are null; try x64 = true or smaller values)" if bad else ""))
    print(f"wrote {args.out}: results.parquet, results.csv, sweep.json, report.html, "
          f"{len(info.get('figures', []))} figures")
    return 0
