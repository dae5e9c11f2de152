"""Benchmark: the sweep engine's systems per second, on one device, on every host device of one
process, and over 2 processes; against the hand-tuned kernel of benchmarks/simulate.py; and
the cost of resuming.

Workload (stated in the output): S = 4,096 synthetic systems (normal F, random spectrum,
half of them with a complex top pair), d = 64, 4 heads, n = 32 tokens, softmax, T = 200,
rule ``paper``, every measure on, float32, the engine's default chunking. Each variant runs
in a fresh process: a warm-up sweep of one chunk's size (it compiles the chunk program),
then the timed sweep of all S systems into a fresh folder (chunks written, table merged,
results.parquet written; no figures).

1. one device (``--xla_force_host_platform_device_count=1``);
2. all host devices of one process (``--xla_force_host_platform_device_count=N``, N = cores);
3. 2 processes x 1 device (jax.distributed on 127.0.0.1, gloo collectives), each worker's XLA
   single-threaded as ``powerlens sweep --processes 2`` runs them on 2 cores
   (:func:`powerlens._src.runtime.threads.worker_env`);
4. the hand-tuned variant of benchmarks/simulate.py (one ``jit(shard_map(lax.map(vmap(simulate))))``
   call over the N host devices, chunks of 8, systems prebuilt on the host, not timed) on
   ``--kernel-systems`` systems of the same shapes, in the process of (2): systems per
   second of the kernel alone, against the engine's (which builds every system on the device);
5. resumption, in the process of (1): the same sweep resumed from a folder holding half of
   its chunks (the other half computed) and from a finished folder (nothing computed),
   against the uninterrupted run.

    python benchmarks/sweep.py [--systems 4096] [--steps 200] [--kernel-systems 512]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def spec_of(args, systems: int) -> dict:
    return {"name": "bench", "seed": 0, "grid": {"beta": [1.0]},
            "system": {"kind": "normal", "d": args.d, "tokens": args.tokens, "heads": args.heads, "pair": 0.5,
                       "init": "sphere", "replicates": systems},
            "run": {"steps": args.steps}}


def timed_sweep(spec, out, **kw):
    from powerlens._src.sweeps.api import sweep
    t0 = time.perf_counter()
    df = sweep(spec, out=out, progress=False, report_files=False, **kw)
    return time.perf_counter() - t0, df


def worker(args) -> dict:
    """One variant, in this process (see the module docstring); prints one JSON line."""
    from powerlens._src.runtime import distributed, threads
    multi = distributed.initialize(args.coordinator, args.num_processes, args.process_id, timeout=120) \
        if args.coordinator else False
    if multi:
        threads.start_xla()                         # one XLA thread when worker_env asked (as `powerlens sweep`)
    import jax
    from powerlens._src.sweeps.engine import Engine
    from powerlens._src.sweeps.spec import load_spec
    spec = load_spec(spec_of(args, args.systems))
    chunk = Engine(spec, None, progress=False).plan[0].size
    # the processes of one group share the folder the launcher made (every one writes its chunks there)
    tmp = args.tmp if args.coordinator else tempfile.mkdtemp(prefix="bench-sweep-", dir=args.tmp)
    warm_spec = spec_of(args, chunk * jax.process_count())
    warm_spec["run"]["chunk_size"] = chunk                      # the timed run's chunk shape: compiled once
    warm, _ = timed_sweep(warm_spec, os.path.join(tmp, "warm"))
    t, df = timed_sweep(spec, os.path.join(tmp, "run"))
    out = {"devices": jax.device_count(), "processes": jax.process_count(), "chunk": chunk, "warmup_s": warm,
           "seconds": t, "systems": args.systems, "systems_per_s": args.systems / t}
    if args.resume and jax.process_index() == 0:
        out.update(resume(args, spec, os.path.join(tmp, "run"), t))
    if args.kernel_systems and jax.process_index() == 0:
        out.update(kernel(args))
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    if not args.coordinator:                   # a group's shared folder is removed by the launcher
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resume(args, spec, done_folder, t_full) -> dict:
    """Resume from half the chunks and from all of them (copies of the finished folder)."""
    chunks = sorted(os.listdir(os.path.join(done_folder, ".chunks")))
    half = os.path.join(os.path.dirname(done_folder), "half")
    shutil.copytree(done_folder, half)
    for name in chunks[len(chunks) // 2:]:
        os.unlink(os.path.join(half, ".chunks", name))
    os.unlink(os.path.join(half, "results.parquet"))
    t_half, _ = timed_sweep(spec, half)
    t_all, _ = timed_sweep(spec, done_folder)
    computed = len(chunks) - len(chunks) // 2
    return {"resume_half_s": t_half, "resume_all_s": t_all, "resume_computed_fraction": computed / len(chunks),
            "resume_overhead": (t_half - t_full * computed / len(chunks)) / t_full}


def kernel(args) -> dict:
    """The hand-tuned variant of benchmarks/simulate.py, timed as it times it (best of 3)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    sys.path.insert(0, HERE)
    from simulate import build  # noqa: E402  (benchmarks/simulate.py)
    from powerlens import Dynamics, simulate
    S, C = args.kernel_systems, 8
    _, stacked, subs, X0 = build(S, args.d, args.heads, args.tokens, args.steps)
    mesh = Mesh(np.array(jax.devices()), ("s",))
    local = S // jax.device_count()
    one = lambda lay, x, sub: simulate(lay, x, sub, dynamics=Dynamics())

    def chunked_local(stacked, X0, subs):
        split = lambda a: a.reshape((local // C, C) + a.shape[1:])
        out = jax.lax.map(lambda a: jax.vmap(one)(*a), jax.tree_util.tree_map(split, (stacked, X0, subs)))
        return jax.tree_util.tree_map(lambda a: a.reshape((local,) + a.shape[2:]), out)

    run = jax.jit(jax.shard_map(chunked_local, mesh=mesh, in_specs=P("s"), out_specs=P("s")))
    inputs = jax.device_put((stacked, X0, subs), NamedSharding(mesh, P("s")))
    jax.block_until_ready(run(*inputs))
    best = min(_timed(lambda: jax.block_until_ready(run(*inputs))) for _ in range(3))
    return {"kernel_systems": S, "kernel_s": best, "kernel_systems_per_s": S / best}


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _env(devices: int) -> dict:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    return env


def _launch(args, extra, devices, n=1):
    """Run the worker in n fresh processes (n > 1: a jax.distributed group on 127.0.0.1)."""
    base = [sys.executable, os.path.abspath(__file__), "--worker", "--systems", str(args.systems), "--steps",
            str(args.steps), "--d", str(args.d), "--tokens", str(args.tokens), "--heads", str(args.heads),
            "--tmp", args.tmp, *extra]
    if n == 1:
        procs = [subprocess.Popen(base, stdout=subprocess.PIPE, text=True, env=_env(devices))]
    else:
        from powerlens._src.runtime.distributed import free_port
        addr = f"127.0.0.1:{free_port()}"
        shared = tempfile.mkdtemp(prefix="bench-sweep-", dir=args.tmp)
        at = base.index("--tmp") + 1
        base = base[:at] + [shared] + base[at + 1:]
        from powerlens._src.runtime.threads import worker_env
        env = worker_env(n)                         # what `powerlens sweep --processes n` gives its workers
        env.update({k: v for k, v in _env(devices).items() if k != "XLA_FLAGS"})
        env["XLA_FLAGS"] = (_env(devices)["XLA_FLAGS"] + " " + worker_env(n).get("XLA_FLAGS", "")).strip()
        procs = [subprocess.Popen(base + ["--coordinator", addr, "--num-processes", str(n), "--process-id", str(i)],
                                  stdout=subprocess.PIPE, text=True, env=env) for i in range(n)]
    outs = [p.communicate()[0] for p in procs]
    if n > 1:
        shutil.rmtree(shared, ignore_errors=True)
    if any(p.returncode for p in procs):
        raise SystemExit(f"a benchmark worker failed: {[p.returncode for p in procs]}")
    line = next(l for o in outs for l in o.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kernel-systems", type=int, default=512)
    ap.add_argument("--tmp", default=None, help="folder for the sweeps' output folders (default: the system's)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", help=argparse.SUPPRESS)
    ap.add_argument("--num-processes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    sys.path.insert(0, HERE)
    import benchdoc
    benchdoc.add_doc_option(ap, "sweep")
    args = ap.parse_args(argv)
    args.tmp = args.tmp or tempfile.gettempdir()
    if args.worker:
        worker(args)
        return
    with benchdoc.Capture() as printed:
        one, many, two = measure(args)
    table = benchdoc.markdown_table(
        ("variant", "systems per second", "time", "over one device"),
        [["1 process × 1 device", f"{one['systems_per_s']:.1f}", f"{one['seconds']:.2f} s", "1.00×"],
         [f"1 process × {many['devices']} devices", f"{many['systems_per_s']:.1f}", f"{many['seconds']:.2f} s",
          f"{many['systems_per_s'] / one['systems_per_s']:.2f}×"],
         ["2 processes × 1 device", f"{two['systems_per_s']:.1f}", f"{two['seconds']:.2f} s",
          f"{two['systems_per_s'] / one['systems_per_s']:.2f}×"],
         [f"hand-tuned kernel, {many['devices']} devices ({many['kernel_systems']} prebuilt systems)",
          f"{many['kernel_systems_per_s']:.1f}", f"{many['kernel_s']:.3f} s",
          f"{many['kernel_systems_per_s'] / one['systems_per_s']:.2f}×"],
         ["resumed, half the chunks present", None, f"{one['resume_half_s']:.2f} s", None],
         ["resumed, every chunk present", None, f"{one['resume_all_s']:.2f} s", None]])
    benchdoc.write_if_asked(args, "sweep", argv, [table], printed.text, packages=("pandas", "pyarrow"),
                            summary=f"The sweep engine: {args.systems} synthetic systems, d = {args.d}, "
                                    f"{args.heads} heads, {args.tokens} tokens, softmax, T = {args.steps}, paper "
                                    "rule, every measure, float32, each variant in a fresh process after a "
                                    "compiling warm-up.")
    return one, many, two


def measure(args):
    """The three launches (one device, every host device, two processes), printed; their numbers."""
    cores = os.cpu_count() or 1
    print(f"workload: {args.systems} systems, d={args.d}, {args.heads} heads, n={args.tokens} tokens, softmax, "
          f"T={args.steps}, rule paper, measures on, float32; {cores} CPU cores; default chunking")
    one = _launch(args, ["--resume", "--kernel-systems", "0"], 1)
    print(f"[1 process x 1 device]       {one['systems_per_s']:8.1f} systems/s  ({one['seconds']:.2f} s; chunks of "
          f"{one['chunk']}; warm-up/compile {one['warmup_s']:.1f} s)")
    many = _launch(args, ["--kernel-systems", str(args.kernel_systems)], cores)
    print(f"[1 process x {many['devices']} devices]     {many['systems_per_s']:8.1f} systems/s  ({many['seconds']:.2f} s)")
    two = _launch(args, ["--kernel-systems", "0"], 1, n=2)
    print(f"[2 processes x 1 device]     {two['systems_per_s']:8.1f} systems/s  ({two['seconds']:.2f} s)")
    k = many["kernel_systems_per_s"]
    print(f"[hand-tuned kernel, {many['devices']} devices] {k:8.1f} systems/s  ({many['kernel_s']:.3f} s for "
          f"{many['kernel_systems']} prebuilt systems, benchmarks/simulate.py's shard_map x chunks of 8)")
    r_many, r_two = many["systems_per_s"] / one["systems_per_s"], two["systems_per_s"] / one["systems_per_s"]
    r_kernel = many["systems_per_s"] / k
    print(f"ratios: {many['devices']} devices / 1 device = {r_many:.2f}x; 2 processes / 1 device = {r_two:.2f}x; "
          f"engine / hand-tuned kernel = {r_kernel:.2f} (same devices)")
    print(f"resume: half the chunks present {one['resume_half_s']:.2f} s for {one['resume_computed_fraction']:.0%} "
          f"of the work -> overhead {100 * one['resume_overhead']:+.1f}% of the run; all present "
          f"{one['resume_all_s']:.2f} s ({100 * one['resume_all_s'] / one['seconds']:.1f}% of the run)")
    print(f"targets: 2 processes >= 1.7x one device: {'met' if r_two >= 1.7 else 'NOT met'}; engine within 10% of "
          f"the hand-tuned kernel: {'met' if r_kernel >= 0.9 else 'NOT met'}; resume overhead < 5%: "
          f"{'met' if one['resume_overhead'] < 0.05 else 'NOT met'}")
    return one, many, two


if __name__ == "__main__":
    main()
