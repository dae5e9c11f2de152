"""Workloads A-E of ``benchmarks/vs_torch.py`` on whatever device JAX sees (GPU, TPU or CPU),
powerlens only, timings written to a JSON file. One short script, meant to be run once on a
lent accelerator machine:

    python benchmarks/gpu.py --out gpu.json            # full sizes
    python benchmarks/gpu.py --tiny --out tiny.json    # what the test suite runs on CPU

    A  MiniLM and SmolLM2, rules paper and full, states only and with every measure
    B  MiniLM layer 3 iterated T = 1,000 times (1 x 32 tokens)
    C  jax.grad of mean gamma w.r.t. the last W_o through all MiniLM layers
    D  the synthetic sweep of benchmarks/simulate.py (256 systems, T = 200)
    E  gradient steering of MiniLM's last layer over 64 directions, 200 Adam steps: the
       vmapped optimiser alone (solve_many_jit) and end to end (optimize_steering)

On a GPU, workload A also runs the paper rule's states in bfloat16 twice: with XLA's attention
and with cuDNN's fused flash attention (``Dynamics(attention_block="cudnn")``, i.e.
``jax.nn.dot_product_attention(implementation="cudnn")``; cuDNN has no float32 kernel, and
powerlens computes in float32 otherwise), each cuDNN entry with its largest difference from
the XLA states. Elsewhere those entries say why they were skipped.

Each entry holds the best of ``--repeat`` timed calls after a compiling warm-up, and the
compile time of that warm-up. torch is not needed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import benchdoc  # noqa: E402
import powerlens as pl  # noqa: E402


def timed(fn, repeat):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    compile_s = time.perf_counter() - t0
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return {"seconds": best, "first_call_seconds": compile_s}


def tokens(model, B, n, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, min(model.embeddings["word"].shape[0], 20000), size=(B, n))
    return pl.embed_ids(model, ids, np.ones((B, n), bool))


def in_bfloat16(model):
    """``model`` with its layers cast to bfloat16."""
    cast = lambda a: a.astype(jnp.bfloat16) if jnp.issubdtype(a.dtype, jnp.floating) else a
    return model.replace(layers=jax.tree_util.tree_map(cast, model.layers))


def fused_attention_entries(name, model, B, n, x0, valid, add, repeat):
    """Workload A's bfloat16 states with XLA's and with cuDNN's attention (GPU only)."""
    from powerlens._src.dynamics.attention import check_fused_attention
    size = f"{B}x{n}"
    try:
        check_fused_attention(model.layers.layer(0), jnp.bfloat16)
    except ValueError as exc:
        add(workload="A", model=name, size=size, rule="paper", what="states bfloat16 cudnn", skipped=str(exc))
        return
    bf16 = in_bfloat16(model)
    xla, fused = pl.Dynamics(rule="paper"), pl.Dynamics(rule="paper", attention_block="cudnn")
    run = lambda dynamics: pl.run_states(bf16, x0, valid, dynamics=dynamics)
    add(workload="A", model=name, size=size, rule="paper", what="states bfloat16 xla", **timed(lambda: run(xla), repeat))
    try:        # never run on a GPU before: a failure is recorded, and the other timings still written
        diff = jnp.max(jnp.abs((run(fused) - run(xla)).astype(jnp.float32)))
        add(workload="A", model=name, size=size, rule="paper", what="states bfloat16 cudnn",
            max_abs_diff_from_xla=float(diff), **timed(lambda: run(fused), repeat))
    except Exception as exc:                                          # noqa: BLE001 - recorded
        add(workload="A", model=name, size=size, rule="paper", what="states bfloat16 cudnn",
            error=f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}")


def steering_problem(model, K, steps):
    """Workload E (the problem of benchmarks/steering.py and of vs_torch.py's workload E): the
    vmapped optimiser alone on the prepared problem, and the public API end to end."""
    from powerlens._src.steering.optimize import AlignSettings, last_layer_terms, prepare_problem, solve_many_jit
    from powerlens._src.steering.rank1 import host_matrices
    L = model.layers
    x0, valid = pl.embed(model, ["The cat sat quietly on the warm windowsill.",
                                 "Power iteration finds the dominant eigenvector of a matrix."])
    D = np.random.default_rng(0).standard_normal((K, L.config.d_model))
    D /= np.linalg.norm(D, axis=1, keepdims=True)
    X, vb, tail, l, kb = prepare_problem(L, x0, valid)
    R = jnp.asarray(host_matrices(L, l)[1], jnp.float32)
    pm = last_layer_terms(L, X, vb, l, kb, "softmax", None) if tail == (l,) else None
    U, keys = jnp.asarray(D, jnp.float32), jax.random.split(jax.random.PRNGKey(0), K)
    opt = dict(target=0.9, reduce="min", param="lowrank", rank=1, steps=steps, lr=1e-2, mu=100.0, dual_every=10,
               tol=1e-4, signed=False)
    kw = dict(opt, layer=l, tail=tail, rule="paper", attention="softmax", keep_bias=kb, w_kind="value")
    solve = lambda: solve_many_jit(L, X, vb, U, keys, R, None, pm, settings=AlignSettings(**kw))
    api = lambda: pl.optimize_steering(
        L, x0, pl.AlignmentObjective(D, opt["target"], opt["reduce"], opt["signed"]), valid=valid,
        config=pl.SteeringConfig(rank=opt["rank"], steps=steps, lr=opt["lr"], mu=opt["mu"],
                                 dual_every=opt["dual_every"], tol=opt["tol"], w="value"))
    return solve, api


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu.json")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    benchdoc.add_doc_option(ap, "gpu")
    args = ap.parse_args(argv)
    with benchdoc.Capture() as printed:
        doc = measure(args)
    rows = [[r["workload"], r["model"], r["size"].replace("x", " × "), r.get("rule"), r["what"],
             f"{r['seconds']:.4g} s" if "seconds" in r else r.get("skipped") or r.get("error"),
             f"{r['first_call_seconds']:.3g} s" if "first_call_seconds" in r else None] for r in doc["results"]]
    table = benchdoc.markdown_table(("workload", "model", "prompts × tokens", "rule", "what", "best time",
                                     "first call (compiles)"), rows)
    dev = jax.devices()[0]
    benchdoc.write_if_asked(args, "gpu", argv, [table], printed.text,
                            accelerator="" if dev.platform == "cpu" else f"{dev.device_kind} × {jax.device_count()}",
                            summary="Workloads A-E of benchmarks/vs_torch.py, powerlens only, on the device JAX "
                                    "sees first.")
    return doc


def measure(args) -> dict:
    """Every workload, each entry printed as JSON as it finishes; the JSON document (also
    written to ``--out``)."""
    dev = jax.devices()[0]
    doc = {"device": str(dev), "platform": dev.platform, "device_count": jax.device_count(),
           "jax": jax.__version__, "python": platform.python_version(), "tiny": args.tiny, "results": []}

    def add(**entry):
        doc["results"].append(entry)
        print(json.dumps(entry), flush=True)

    minilm = pl.load("minilm")
    models = {"minilm": minilm} if args.tiny else {"minilm": minilm, "smollm2": pl.load("smollm2")}
    sizes = [(1, 16), (2, 8)] if args.tiny else [(1, 16), (8, 128), (32, 128), (8, 512)]
    for name, model in models.items():
        subs = pl.reference_subspaces(pl.layer_spectra(np.asarray(pl.layer_matrices(model.layers))))
        extra = [(1, 2048)] if name == "smollm2" else []
        for B, n in sizes + extra:
            x0, valid = tokens(model, B, n)
            for rule in ("paper", "full"):
                add(workload="A", model=name, size=f"{B}x{n}", rule=rule, what="states",
                    **timed(lambda: pl.run_states(model, x0, valid, dynamics=pl.Dynamics(rule=rule)), args.repeat))
            add(workload="A", model=name, size=f"{B}x{n}", rule="paper", what="measures",
                **timed(lambda: pl.simulate_batch(model.layers, x0, subs, valid=valid), args.repeat))
            fused_attention_entries(name, model, B, n, x0, valid, add, args.repeat)
    steps = 20 if args.tiny else 1000
    shared = minilm.replace(layers=minilm.layers.shared(3, steps))
    x0, valid = tokens(minilm, 1, 32)
    add(workload="B", model="minilm layer 3", size="1x32", what=f"T={steps}",
        **timed(lambda: pl.run_states(shared, x0, valid, dynamics=pl.Dynamics()), args.repeat))

    u = jnp.asarray(np.random.default_rng(1).standard_normal(minilm.config.d_model), jnp.float32)
    x4, v4 = tokens(minilm, 4, 32)

    def loss(W, layers, x, v):
        lay = layers.replace(W_o=layers.W_o.at[-1].set(W))
        Y = jax.vmap(lambda a, b: pl.run(lay, a, b, dynamics=pl.Dynamics(),
                                         observers={"final": pl.final()})["final"])(x, v)
        return jnp.mean(jnp.abs(Y @ u) / (jnp.linalg.norm(Y, axis=-1) * jnp.linalg.norm(u)))
    grad = jax.jit(jax.grad(loss))
    L = minilm.layers
    add(workload="C", model="minilm", size="4x32", what="grad W_o",
        **timed(lambda: grad(L.W_o[-1], L, x4, v4), args.repeat))

    from simulate import build
    S, T = (8, 10) if args.tiny else (256, 200)
    _, stacked, ssubs, X0 = build(S, 64, 4, 32, T)
    add(workload="D", model=f"{S} synthetic systems", size=f"{S}x32", what=f"T={T}",
        **timed(lambda: pl.simulate_sweep(stacked, X0, ssubs), args.repeat))

    K, steps = (8, 20) if args.tiny else (64, 200)
    solve, api = steering_problem(minilm, K, steps)
    add(workload="E", model="minilm last layer", size=f"{K} dirs", what=f"solve {steps} Adam steps",
        **timed(solve, args.repeat))
    add(workload="E", model="minilm last layer", size=f"{K} dirs", what=f"api {steps} Adam steps",
        **timed(lambda: api().norm, args.repeat))
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=2)
    print(f"wrote {args.out}")
    return doc


if __name__ == "__main__":
    main()
