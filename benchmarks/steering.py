"""Benchmark: gradient steering of 64 target directions, vmapped vs a Python loop.

System (synthetic, stated in the output): one softmax attention layer, d = 16, 4 heads of
size 4, non-normal F with spectrum (2, 1, -0.5, 0, ...), beta = 1, rule ``paper``;
4 prompts of 8 tokens in a cone of half-angle 0.4 rad; 64 targets at 0.9 rad from the
cone axis; param ``lowrank`` (rank 1), ``steps`` Adam steps, target mean alignment 0.95.

Both runs call the same pure ``solve_one`` with the same number of optax steps: once as
one jit-compiled ``vmap`` over the 64 directions, once as 64 calls of the jit-compiled
single-direction function. Compilation is excluded (each is warmed up first).

    python benchmarks/steering.py [--steps 200] [--directions 64]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from powerlens.dynamics import synthetic as S  # noqa: E402
from powerlens.steering.optimize import optimize_steering  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--directions", type=int, default=64)
    ap.add_argument("--param", default="lowrank", choices=["lowrank", "w_alpha"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    d, heads, n, B = 16, 4, 8, 4
    layers = S.synthetic_system([2.0, 1.0, -0.5], kind="nonnormal", heads=heads, d=d, seed=1)
    rng = np.random.default_rng(0)
    c = S.sphere_tokens(rng, 1, d)[0]
    x0 = np.stack([S.cone_tokens(rng, n, c, 0.4) for _ in range(B)])
    D = S.cone_tokens(rng, args.directions, c, 0.9)
    kw = dict(target=0.95, reduce="mean", param=args.param, rank=1, steps=args.steps)

    def timed(vectorize):
        r = optimize_steering(layers, x0, D, vectorize=vectorize, **kw)  # warm-up / compile
        best = np.inf
        for _ in range(args.repeats):
            t = time.perf_counter()
            r = optimize_steering(layers, x0, D, vectorize=vectorize, **kw)
            best = min(best, time.perf_counter() - t)
        return best, r

    t_vec, r_vec = timed(True)
    t_loop, r_loop = timed(False)
    same = np.allclose(r_vec.norm, r_loop.norm, rtol=1e-2, equal_nan=True)
    print(f"system: synthetic one-layer softmax attention, d={d}, heads={heads}, nonnormal spectrum (2, 1, -0.5), "
          f"rule paper; {B} prompts x {n} tokens; param={args.param}, {args.steps} Adam steps; "
          f"backend {jax.default_backend()} ({os.cpu_count()} cpus)")
    print(f"{args.directions} directions vmapped : {t_vec:8.3f} s")
    print(f"{args.directions} directions in loop : {t_loop:8.3f} s")
    print(f"ratio loop / vmapped         : {t_loop / t_vec:8.1f}x  (target >= 8x)")
    print(f"results agree (norm, rtol 1e-2): {same}; feasible {int(r_vec.feasible.sum())}/{len(D)}; "
          f"median ||dO|| gradient / closed form = {np.nanmedian(r_vec.norm_ratio):.3f}")


if __name__ == "__main__":
    main()
