"""Benchmark: gradient steering of 64 target directions, one vmapped run vs a Python loop.

Two comparisons, compilation excluded (each is warmed up first; best of ``--repeats``, default 10):

  solve only   the same pure ``solve_one`` (powerlens.steering.optimize), same optax steps,
               same prepared problem (tokens entering the steered layer, its unsteered
               output p and head mix m, the reduced bases; computed once): one jit-compiled
               ``vmap`` over the directions vs one jit-compiled call per direction;
  public API   ``optimize_steering(layers, x0, D)`` once with all directions vs once per
               direction (what a user's loop does: each call also prepares its problem).

Problems:

  minilm     all-MiniLM-L6-v2 (d = 384, 12 heads), its last layer steered, 2 prompts
             (24 tokens), 64 random unit directions, sign-free worst-token alignment 0.9
  synthetic  one softmax layer, d = 16, 4 heads, non-normal spectrum (2, 1, -0.5),
             4 prompts x 8 tokens in a cone, 64 targets at 0.9 rad from its axis

    python benchmarks/steering.py [--problem minilm|synthetic|both] [--steps 200] [--directions 64]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

# Expose every CPU core as a JAX host device, so the vmapped run can split the directions
# over the cores (as on several accelerators); the loop runs each direction on one device.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={os.cpu_count() or 1}").strip()

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchdoc  # noqa: E402

from powerlens.dynamics import synthetic as S  # noqa: E402
from powerlens.steering.optimize import (last_layer_terms, optimize_steering, prepare_problem,  # noqa: E402
                                         solve_many_jit, solve_many_sharded, solve_one_jit)
from powerlens.steering.rank1 import host_matrices  # noqa: E402


def problem(name, K, rng):
    if name == "synthetic":
        d = 16
        layers = S.synthetic_system([2.0, 1.0, -0.5], kind="nonnormal", heads=4, d=d, seed=1)
        c = S.sphere_tokens(rng, 1, d)[0]
        x0 = np.stack([S.cone_tokens(rng, 8, c, 0.4) for _ in range(4)])
        return layers, x0, np.ones(x0.shape[:2], bool), S.cone_tokens(rng, K, c, 0.9), "synthetic, d=16, 4 heads, 4x8 tokens"
    from powerlens.models import embed, load
    model = load("minilm")
    x0, valid = embed(model, ["The cat sat quietly on the warm windowsill.",
                              "Power iteration finds the dominant eigenvector of a matrix."])
    D = rng.standard_normal((K, model.layers.config.d_model))
    D /= np.linalg.norm(D, axis=1, keepdims=True)
    n_tok = int(np.asarray(valid).sum())
    return model.layers, np.asarray(x0), np.asarray(valid), D, f"all-MiniLM-L6-v2 last layer, d=384, {n_tok} tokens"


def run(name, args):
    rng = np.random.default_rng(0)
    layers, x0, valid, D, label = problem(name, args.directions, rng)
    X, vb, tail, l, kb = prepare_problem(layers, x0, valid)
    _, V, _ = host_matrices(layers, l)
    dtype = layers.W_v.dtype
    R = jnp.asarray(V, dtype)
    pm = last_layer_terms(layers, X, vb, l, kb, "softmax", None) if tail == (l,) else None
    U = jnp.asarray(D, dtype)
    keys = jax.random.split(jax.random.PRNGKey(0), len(D))
    kw = dict(layer=l, tail=tail, rule="paper", attention="softmax", keep_bias=kb, target=0.9, reduce="min",
              param="lowrank", rank=1, steps=args.steps, lr=1e-2, mu=100.0, dual_every=10, tol=1e-4,
              w_kind="value", signed=False)
    vec1 = lambda: solve_many_jit(layers, X, vb, U, keys, R, None, pm, **kw)
    vec = lambda: solve_many_sharded(layers, X, vb, U, keys, R, None, pm, **kw)
    loop = lambda: [solve_one_jit(layers, X, vb, U[i], keys[i], R, None, pm, **kw) for i in range(len(D))]

    def timed(f):
        out = jax.block_until_ready(f())
        best = np.inf
        for _ in range(args.repeats):
            t = time.perf_counter()
            out = jax.block_until_ready(f())
            best = min(best, time.perf_counter() - t)
        return best, out

    t_vec1, _ = timed(vec1)
    t_vec, r_vec = timed(vec)
    t_loop, r_loop = timed(loop)
    # the same at the level of the public API: one optimize_steering call with all directions
    # against one call per direction (each call prepares its problem: entering states, bases)
    api_kw = dict(valid=valid, target=0.9, reduce="min", param="lowrank", rank=1, steps=args.steps, w="value",
                  signed=False)
    t_api_vec, _ = timed(lambda: optimize_steering(layers, x0, D, **api_kw).norm)
    t_api_loop, _ = timed(lambda: [optimize_steering(layers, x0, D[i], **api_kw).norm for i in range(len(D))])
    norm_loop = np.array([float(r["norm"]) for r in r_loop])
    rel = np.abs(np.asarray(r_vec["norm"]) - norm_loop) / norm_loop
    ratio = np.asarray(r_vec["norm"]) / np.asarray(r_vec["closed_norm"])
    print(f"[{name}] {label}; {len(D)} directions, {args.steps} Adam steps, rank 1, backend "
          f"{jax.default_backend()} ({os.cpu_count()} cpus)")
    print(f"  solve only : vmapped over {jax.device_count()} devices {t_vec:.4f} s (on one device {t_vec1:.4f} s) | "
          f"loop {t_loop:.4f} s | ratio {t_loop / t_vec:.1f}x (one device {t_loop / t_vec1:.1f}x) (target >= 8x)")
    print(f"  public API : one optimize_steering call {t_api_vec:.3f} s | one call per direction "
          f"{t_api_loop:.3f} s | ratio {t_api_loop / t_api_vec:.1f}x (target >= 8x)")
    print(f"  results: ||dO|| vmapped vs loop, median rel. diff {np.median(rel):.1e}, max {np.max(rel):.1e} "
          f"(float32 paths) | feasible {int(np.asarray(r_vec['feasible']).sum())}"
          f"/{len(D)} | median ||dO|| gradient / closed form {np.nanmedian(ratio):.3f}")
    return {"problem": label, "devices": jax.device_count(), "solve_vmapped": t_vec, "solve_one_device": t_vec1,
            "solve_loop": t_loop, "api_vmapped": t_api_vec, "api_loop": t_api_loop}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problem", default="both", choices=["minilm", "synthetic", "both"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--directions", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    benchdoc.add_doc_option(ap, "steering")
    args = ap.parse_args(argv)
    with benchdoc.Capture() as printed:
        results = [run(name, args) for name in (["minilm", "synthetic"] if args.problem == "both"
                                                 else [args.problem])]
    rows = [[r["problem"], f"{r['solve_vmapped']:.4f} s ({r['devices']} devices), {r['solve_one_device']:.4f} s (1)",
             f"{r['solve_loop']:.4f} s", f"{r['solve_loop'] / r['solve_vmapped']:.1f}×",
             f"{r['api_vmapped']:.3f} s", f"{r['api_loop']:.3f} s", f"{r['api_loop'] / r['api_vmapped']:.1f}×"]
            for r in results]
    table = benchdoc.markdown_table(("problem", "solve: vmapped", "solve: one call per direction", "ratio",
                                     "API: one call", "API: one call per direction", "ratio"), rows)
    benchdoc.write_if_asked(args, "steering", argv, [table], printed.text, packages=("optax",),
                            summary=f"The optax steering solve ({args.steps} Adam steps, rank 1, worst-token "
                                    f"alignment 0.9) for {args.directions} directions, vmapped against one call "
                                    "per direction; best of the repeats, compilation excluded.")
    return results


if __name__ == "__main__":
    main()
