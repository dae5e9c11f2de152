"""Benchmark: a sweep of synthetic systems, one jit(vmap) call vs a NumPy loop.

Workload (stated in the output): S = 256 synthetic shared-weight systems, d = 64, 4 heads of
size 16, n = 32 tokens, softmax attention (beta = 1), T = 200 steps, rule ``paper``, every
measure on (gamma, gamma_before and rho against 3 reference subspaces, rotation,
consensus, rank-collapse residual, pairwise cosine); float32.

1. JAX: ``jax.jit(jax.vmap(simulate))`` over a stacked Layers pytree (leading system axis)
   and stacked Subspaces, timed after a warm-up call (compile time reported apart), with
   ``block_until_ready``; and the same vmap applied to chunks of ``--chunk`` systems under
   ``lax.map`` inside the one jit call (each chunk's weights then stay in cache for all T
   steps: ~1.8x less CPU time than one vmap over all 256 on a 2-core machine). The summary
   line uses the faster of the two. Wall and CPU (process) time are both printed: on a
   shared machine the CPU-time ratio is the steadier number.
2. NumPy: the same maths, ``benchmarks/numpy_baseline.py`` (vectorised within a step, a
   Python loop over steps and systems), float32, on a subset of the systems and
   extrapolated linearly to S (stated in the output).

FLOPs are counted analytically per step and system (multiply-add = 2 FLOPs):

    QKV projections     3 * 2 n d (H e)
    scores, A V         2 * 2 H n n e
    softmax             5 H n n          (max, subtract, exp, sum, divide)
    output projection   2 n (H e) d
    residual + N2       4 n d
    measures            projection on the m = 3 references (k = 2 columns each, which also
                        gives the plane angle): 2 n d k m, row norms 2 n d,
                        consensus/rank-collapse/pairwise 12 n d (a shared system projects
                        each state once: the "before" of step t is the "after" of t - 1)

The achieved rate is printed beside the rate of a 2048^3 float32 matmul in jax, measured
in the same process.

    python benchmarks/simulate.py [--systems 256] [--steps 200] [--numpy-subset 16]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

# Expose every CPU core as a JAX host device, so that the sweep can be split over cores with
# shard_map (XLA runs one small-matmul program per device on one core otherwise). Set before
# jax is imported; it does nothing on GPU/TPU backends. Only when run as a script: imported
# (by the tests), it must not change the environment their subprocesses inherit.
if __name__ == "__main__" and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={os.cpu_count() or 1}").strip()

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import benchdoc  # noqa: E402
import numpy_baseline as NB  # noqa: E402
from powerlens import (Dynamics, Subspaces, layer_matrices, layer_spectra, reference_subspaces, simulate,  # noqa: E402
                       sphere_tokens, synthetic_system)


def build(S, d, heads, n, T, seed=0):
    """S systems: spectrum = a top eigenvalue (real or a complex pair) + uniform noise."""
    rng = np.random.default_rng(seed)
    systems, subs, X0 = [], [], []
    for s in range(S):
        if s % 2:
            top = [complex(rng.uniform(0.5, 2.0), rng.uniform(0.3, 1.5))]
        else:
            top = [float(rng.uniform(1.0, 3.0))]
        rest = list(rng.uniform(-0.8, 0.8, d - 2))
        kind = "normal" if s % 2 else "symmetric"
        lay = synthetic_system(top + rest, kind=kind, heads=heads, d=d, seed=seed + s, steps=T)
        sp = layer_spectra(np.asarray(layer_matrices(lay)))
        sub = reference_subspaces(sp, seed=seed + s)
        k = sub.basis.shape[-1]
        sub = Subspaces(basis=jnp.pad(sub.basis, [(0, 0)] * 3 + [(0, 2 - k)]), dim=sub.dim)
        systems.append(lay)
        subs.append(sub)
        X0.append(sphere_tokens(rng, n, d).astype(np.float32))
    stack = lambda xs: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *xs)
    return systems, stack(systems), stack(subs), jnp.asarray(np.stack(X0))


def flops_per_step(n, d, H, e, m=3, k=2):
    proj = 3 * 2 * n * d * H * e
    attn = 2 * 2 * H * n * n * e + 5 * H * n * n
    out = 2 * n * H * e * d
    resid = 4 * n * d
    measures = 2 * n * d * k * m + 2 * n * d + 12 * n * d
    return proj + attn + out + resid + measures


def matmul_rate(size=2048, reps=5):
    a = jax.random.normal(jax.random.PRNGKey(0), (size, size), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(1), (size, size), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    best, best_cpu = np.inf, np.inf
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
        best_cpu = min(best_cpu, time.process_time() - c)
    return 2 * size ** 3 / best / 1e9, 2 * size ** 3 / best_cpu / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--numpy-subset", type=int, default=16, help="systems timed in the NumPy loop")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=8,
                    help="also time the sweep as lax.map over chunks of this many vmapped systems "
                         "(keeps each chunk's weights in cache across the T steps; 0 = off)")
    benchdoc.add_doc_option(ap, "simulate")
    args = ap.parse_args(argv)
    with benchdoc.Capture() as printed:
        res = run(args)
    rows = [[f"powerlens, {name}", f"{wall:.3f} s", f"{cpu:.3f} s", f"{res['numpy'][0] / wall:.1f}×",
             f"{res['flops'] / wall / 1e9:.1f} GFLOP/s ({100 * res['flops'] / wall / 1e9 / res['matmul']:.0f} %)"]
            for name, (wall, cpu) in res["jax"].items()]
    t_np, c_np = res["numpy"]
    rows.append(["NumPy loop" + (f" ({res['numpy_timed']} systems timed, extrapolated)"
                                 if res["numpy_timed"] < args.systems else ""),
                 f"{t_np:.2f} s", f"{c_np:.2f} s", "1.0×", f"{res['flops'] / t_np / 1e9:.1f} GFLOP/s"])
    table = benchdoc.markdown_table(("path", "wall time", "CPU time", "speed-up over the NumPy loop (wall)",
                                     "rate (% of a 2048³ matmul)"), rows)
    benchdoc.write_if_asked(args, "simulate", argv, [table], printed.text,
                            summary=f"{args.systems} synthetic shared-weight systems, d = {args.d}, {args.heads} "
                                    f"heads, {args.tokens} tokens, softmax, T = {args.steps}, paper rule, every "
                                    "measure, float32: one compiled call against the same maths in a NumPy loop.")
    return res


def run(args) -> dict:
    """The benchmark; returns {"jax": {variant: (wall s, CPU s)}, "numpy": (wall s, CPU s),
    "numpy_timed": systems timed in NumPy, "flops": the sweep's FLOPs, "matmul": JAX's 2048^3
    GFLOP/s}."""
    S, T, n, d, H = args.systems, args.steps, args.tokens, args.d, args.heads
    e = -(-d // H)
    print(f"devices: {jax.devices()}  |  workload: {S} systems, d={d}, {H} heads x {e}, n={n} tokens, "
          f"softmax, T={T} steps, rule paper, measures on, float32")

    t0 = time.perf_counter()
    systems, stacked, subs, X0 = build(S, d, H, n, T)
    print(f"build (spectra, subspaces): {time.perf_counter() - t0:.1f} s")

    one = lambda lay, x, sub: simulate(lay, x, sub, dynamics=Dynamics())
    variants = {"vmap": jax.jit(jax.vmap(one))}
    C = args.chunk
    if C and S % C == 0 and C < S:
        def chunked(stacked, X0, subs):
            split = lambda a: a.reshape((S // C, C) + a.shape[1:])
            out = jax.lax.map(lambda a: jax.vmap(one)(*a), jax.tree_util.tree_map(split, (stacked, X0, subs)))
            return jax.tree_util.tree_map(lambda a: a.reshape((S,) + a.shape[2:]), out)
        variants[f"vmap in chunks of {C} (lax.map)"] = jax.jit(chunked)
    ndev = jax.device_count()
    if C and ndev > 1 and S % (ndev * C) == 0:
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        mesh = Mesh(np.array(jax.devices()), ("s",))
        local = S // ndev

        def chunked_local(stacked, X0, subs):
            split = lambda a: a.reshape((local // C, C) + a.shape[1:])
            out = jax.lax.map(lambda a: jax.vmap(one)(*a), jax.tree_util.tree_map(split, (stacked, X0, subs)))
            return jax.tree_util.tree_map(lambda a: a.reshape((local,) + a.shape[2:]), out)

        sharded = jax.jit(jax.shard_map(chunked_local, mesh=mesh, in_specs=P("s"), out_specs=P("s")))
        place = lambda tree: jax.device_put(tree, NamedSharding(mesh, P("s")))
        s_in = place((stacked, X0, subs))
        variants[f"shard_map over {ndev} devices x chunks of {C}"] = lambda *_: sharded(*s_in)
    timings = {}
    for name, run in variants.items():
        t0 = time.perf_counter()
        traj = jax.block_until_ready(run(stacked, X0, subs))
        t_first = time.perf_counter() - t0
        wall, cpu = [], []
        for _ in range(args.reps):
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(run(stacked, X0, subs))
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        timings[name] = (min(wall), min(cpu))
        print(f"jax {name}: first call (compile + run) {t_first:.2f} s, compile ~{t_first - min(wall):.2f} s, "
              f"timed {min(wall):.3f} s wall, {min(cpu):.3f} s CPU (best of {args.reps})")
    best = min(timings, key=lambda k: timings[k][0])
    t_jax, c_jax = timings[best]

    # NumPy loop over a subset, extrapolated
    sub_n = min(args.numpy_subset, S)
    params = [NB.layer_arrays(s, dtype=np.float32) for s in systems[:sub_n]]
    basis, dims = np.asarray(subs.basis)[:, 0], np.asarray(subs.dim)[:, 0]      # the one unique layer
    X0n = np.asarray(X0)
    t0, c0 = time.perf_counter(), time.process_time()
    refs = [NB.simulate(params[i], X0n[i], basis[i], dims[i], T, dtype=np.float32) for i in range(sub_n)]
    t_np_sub, c_np_sub = time.perf_counter() - t0, time.process_time() - c0
    t_np, c_np = t_np_sub * S / sub_n, c_np_sub * S / sub_n
    note = "" if sub_n == S else f" (timed {sub_n} systems: {t_np_sub:.2f} s, extrapolated linearly to {S})"
    print(f"numpy loop: {t_np:.2f} s wall, {c_np:.2f} s CPU{note}")
    # same maths: compare the measures of the timed systems (float32 rounding differences grow
    # along the 200 steps, so the tight check is on the first 10)
    err10 = max(np.nanmax(np.abs(np.asarray(traj.gamma[i, :10]) - refs[i]["gamma"][:10])) for i in range(sub_n))
    err = max(np.nanmax(np.abs(np.asarray(traj.gamma[i]) - refs[i]["gamma"])) for i in range(sub_n))
    errc = max(np.max(np.abs(np.asarray(traj.consensus[i]) - refs[i]["consensus"])) for i in range(sub_n))
    errr = max(np.nanmax(np.abs(np.asarray(traj.rotation[i, :10]) - refs[i]["rotation"][:10]), initial=0.0)
               for i in range(sub_n))
    nan_same = all(np.array_equal(np.isnan(np.asarray(traj.rotation[i])), np.isnan(refs[i]["rotation"]))
                   for i in range(sub_n))
    print(f"check (float32 both): max |gamma_jax - gamma_numpy| = {err10:.1e} over the first 10 steps, "
          f"{err:.1e} over all {T}; max |consensus diff| = {errc:.1e}; max |rotation diff| = {errr:.1e} "
          f"over the first 10 steps (defined on the same steps: {nan_same})")

    fl = flops_per_step(n, d, H, e) * T * S
    achieved = fl / t_jax / 1e9
    print(f"FLOPs: {flops_per_step(n, d, H, e) / 1e6:.3f} MFLOP per step and system, {fl / 1e9:.1f} GFLOP in all")
    mm, mm_cpu = matmul_rate()
    print(f"[{best}] jax_vmap: {t_jax:.3f} s | numpy_loop: {t_np:.2f} s | speedup: {t_np / t_jax:.1f}x | "
          f"achieved: {achieved:.1f} GFLOP/s | matmul: {mm:.1f} GFLOP/s | fraction: {100 * achieved / mm:.0f}%")
    print(f"CPU time (less sensitive to other load on the machine): jax {c_jax:.3f} s, numpy {c_np:.2f} s, "
          f"ratio {c_np / c_jax:.1f}x; achieved {fl / c_jax / 1e9:.1f} GFLOP per CPU-s vs matmul "
          f"{mm_cpu:.1f} GFLOP per CPU-s ({100 * (fl / c_jax) / (mm_cpu * 1e9):.0f}%)")
    print(f"targets: speedup >= 20x: {'met' if t_np / t_jax >= 20 else 'NOT met'}; "
          f">= 25% of matmul: {'met' if achieved >= 0.25 * mm else 'NOT met'}")
    return {"jax": timings, "numpy": (t_np, c_np), "numpy_timed": sub_n, "flops": fl, "matmul": mm}


if __name__ == "__main__":
    main()
