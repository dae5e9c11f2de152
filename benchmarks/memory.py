"""Peak resident memory of a long prompt, of long shared-weight runs, and of loading.

Every case runs in a fresh Python subprocess (``--child``), so no case inherits another's
allocations, compiled programs or allocator pools. Memory is read from /proc/self/status:
VmRSS (now) and VmHWM (peak). Before each measured call the child resets VmHWM to the current
RSS (``echo 5 > /proc/self/clear_refs``), so each peak is the peak *of that call*;
``ru_maxrss`` (the process's lifetime peak) is reported beside it. A run is called twice: the
first call compiles (XLA/LLVM take ~120-150 MB of their own here, whatever the prompt) and runs,
the second runs the compiled program alone; both peaks are reported, and the bound is checked
against the larger.

Cases:

  run    one prompt of ``--prompt`` tokens (default 4,096) through all layers of ``--model``
         (default SmolLM2, 30 layers), rule ``paper``, with every measure
         (``pl.simulate_batch``: the alignment observer against the principal, random and
         other-layer subspaces, the consensus measures, finiteness; no states kept).
         Compared with  float32 parameter bytes + 4 x one layer's activations,  where one
         layer's activations at n tokens are, in float32 (4 B each),

             n d            the tokens entering the layer
           + n (H + 2G) e   q, k, v
           + H n n          the attention scores (softmax weights) of every query head
           + n H e          the heads' outputs (attention-weighted means)
           + n d            the tokens leaving the layer

         (d model width, H query heads, G key/value heads, e head width). At SmolLM2 and
         n = 4,096 the scores are 9 x 4096^2 x 4 B = 604 MB of the 649 MB.
  steps  one layer (``--steps-layer``, default 0) iterated as a shared-weight system for
         T in ``--steps`` (default 10, 100, 1000) steps at ``--steps-prompt`` tokens (default
         256), with every measure: the peak must not grow with T. A control with the states
         kept (``save_states=True``) at the largest T shows that the measurement does see a
         growth of T n d x 4 B when there is one.
  load   ``pl.load(name)`` for every model in the embedded default (minilm, smollm2, gemma3
         where it loads): the peak above the RSS of the initialised runtime, against
         1.5 x the float32 parameter bytes.

Each peak is reported both as the process's absolute peak and as the increment over the
runtime baseline (Python + JAX + powerlens imported, CPU backend initialised, nothing loaded),
because the bounds are about what powerlens allocates, and that baseline (a few hundred MB) is
paid by any JAX program.

    python benchmarks/memory.py [--json memory.json]     # writes docs/benchmarks/memory.md
    python benchmarks/memory.py --quick        # the tiny configuration the test suite runs
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
MB = 1e6


# --------------------------------------------------------------------------- child side

# the /proc/self/status reader and the VmHWM reset are benchmarks/models.py's (standard library only)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchdoc  # noqa: E402
from models import _reset_peak as reset_hwm, _status_kib as status_kb  # noqa: E402


def rss() -> float:
    return status_kb("VmRSS") * 1e3


def hwm() -> float:
    return status_kb("VmHWM") * 1e3


def maxrss() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1e3     # KiB on Linux


def param_bytes(model) -> int:
    """float32 bytes of every parameter array of the model (layers, embeddings, norms, head)."""
    import jax
    import numpy as np
    return int(sum(4 * int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(model)
                   if np.issubdtype(a.dtype, np.floating)))


def layer_activation_floats(cfg, n: int) -> dict:
    """One layer's activations at n tokens (see the module docstring), in floats, by part."""
    d, H, G, e = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    return {"tokens_in": n * d, "qkv": n * (H + 2 * G) * e, "scores": H * n * n, "head_out": n * H * e,
            "tokens_out": n * d}


def runtime():
    """Import and initialise everything a case needs; the baseline RSS after it."""
    sys.path.insert(0, ROOT)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import powerlens as pl
    jax.block_until_ready(jnp.zeros(8) + 1)                          # the CPU backend is up
    pl.layer_spectra, pl.reference_subspaces, pl.simulate_batch, pl.embed_ids  # resolved (lazy exports)
    return jax, np, pl


def prompt(pl, np, model, n, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, min(model.embeddings["word"].shape[0], 20000), size=(1, n))
    return pl.embed_ids(model, ids, np.ones((1, n), bool))


def child(spec: dict) -> dict:
    jax, np, pl = runtime()
    out = {"case": spec["case"], "baseline_rss": rss()}
    if spec["case"] == "load":
        ok = reset_hwm()                              # then read RSS: the peak after it is >= that
        out["baseline_rss"] = rss()
        t0 = time.perf_counter()
        try:
            model = pl.load(spec["model"])
        except Exception as exc:                                      # noqa: BLE001 - reported
            out.update(model=spec["model"], error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            return out
        out.update(model=spec["model"], seconds=time.perf_counter() - t0, peak=hwm(), after=rss(),
                   hwm_reset=ok, ru_maxrss=maxrss(), param_bytes=param_bytes(model),
                   n_layers=len(model.layers.schedule), family=model.info.family if model.info else None)
        return out
    model = pl.load(spec["model"])
    out.update(model=spec["model"], param_bytes=param_bytes(model), load_peak=hwm())
    n = spec["n"]
    layers = model.layers
    if spec["case"] == "steps":
        layers = layers.shared(spec["layer"], spec["T"])
        out.update(T=spec["T"], layer=spec["layer"], save_states=spec.get("save_states", False))
    x0, valid = prompt(pl, np, model, n)
    subs = pl.reference_subspaces(pl.layer_spectra(np.asarray(pl.layer_matrices(layers))))
    jax.block_until_ready((x0, valid, subs.basis))
    call = lambda: jax.block_until_ready(pl.simulate_batch(layers, x0, subs, valid=valid, dynamics=pl.Dynamics(),
                                                           save_states=spec.get("save_states", False)))
    ok = reset_hwm()
    out.update(n=n, steps=len(layers.schedule), before=rss())
    t0 = time.perf_counter()
    traj = call()                                                   # compiles, then runs
    out.update(first_seconds=time.perf_counter() - t0, first_peak=hwm())
    del traj
    reset_hwm()
    out.update(before_steady=rss())
    t0 = time.perf_counter()
    traj = call()                                                   # the compiled program alone
    out.update(seconds=time.perf_counter() - t0, peak=hwm(), hwm_reset=ok, ru_maxrss=maxrss(),
               gamma_last=float(np.asarray(traj.gamma)[0, -1, 0]),
               finite=bool(np.all(np.asarray(traj.finite))))
    cfg = model.layers.config
    out.update(d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, d_head=cfg.d_head,
               activation_floats=layer_activation_floats(cfg, n))
    return out


# --------------------------------------------------------------------------- parent side

def spawn(spec: dict, timeout: float) -> dict:
    env = dict(os.environ)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return dict(spec, error=f"timed out after {timeout:.0f} s")
    for line in proc.stdout.splitlines()[::-1]:
        if line.startswith("RESULT "):
            res = json.loads(line[len("RESULT "):])
            res["wall_seconds"] = time.perf_counter() - t0
            return res
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return dict(spec, error=f"child exited {proc.returncode}: {' | '.join(tail)[:400]}")


def assess_run(r: dict) -> dict:
    """The bound for a run/steps case: float32 parameters + 4 x one layer's activations."""
    if "error" in r:
        return r
    act = 4 * sum(r["activation_floats"].values())
    bound = r["param_bytes"] + 4 * act
    peak = max(r["peak"], r["first_peak"])
    inc = peak - r["baseline_rss"]
    r.update(layer_activation_bytes=act, scores_bytes=4 * r["activation_floats"]["scores"], bound=bound,
             peak_any=peak, peak_over_baseline=inc, run_increment=r["peak"] - r["before_steady"],
             first_increment=r["first_peak"] - r["before"],
             below_bound_absolute=bool(peak <= bound), below_bound_over_baseline=bool(inc <= bound),
             steady_below_bound_absolute=bool(r["peak"] <= bound))
    return r


def assess_load(r: dict) -> dict:
    if "error" in r:
        return r
    inc = r["peak"] - r["baseline_rss"]
    r.update(bound=1.5 * r["param_bytes"], peak_over_baseline=inc, ratio_over_baseline=inc / r["param_bytes"],
             ratio_absolute=r["peak"] / r["param_bytes"], below_bound_over_baseline=bool(inc <= 1.5 * r["param_bytes"]),
             below_bound_absolute=bool(r["peak"] <= 1.5 * r["param_bytes"]))
    return r


def fmt(b) -> str:
    return f"{b / MB:8.1f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="tiny configuration (MiniLM, 32-token prompt, T = 2, 4 at 16 tokens, load minilm)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--steps", default="10,100,1000")
    ap.add_argument("--steps-prompt", type=int, default=256)
    ap.add_argument("--steps-layer", type=int, default=0)
    ap.add_argument("--loads", default="minilm,smollm2,gemma3")
    ap.add_argument("--json", default=None, help="also write every number to this JSON file")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    benchdoc.add_doc_option(ap, "memory")
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return None
    with benchdoc.Capture() as printed:
        doc = measure(args, argv)
    benchdoc.write_if_asked(args, "memory", argv, [memory_table(doc)], printed.text,
                            summary="Peak resident memory, each case in a fresh process: one long prompt through "
                                    "every layer, one layer iterated for more and more steps, and loading each "
                                    "model (the script's docstring defines each bound).")
    return doc


def memory_table(doc: dict) -> list:
    """The cases of ``doc`` as one Markdown table: each peak over the runtime baseline
    against its bound (MB)."""
    mb = lambda b: f"{b / MB:.1f} MB"
    rows = []
    r = doc["run"]
    if r and "error" not in r:
        rows.append([f"{r['model']}, 1 × {r['n']} tokens, every layer, every measure", mb(r["peak_any"]),
                     mb(r["peak_over_baseline"]), f"parameters + 4 × one layer's activations, {mb(r['bound'])}",
                     f"{r['peak_over_baseline'] / r['bound']:.2f}"])
    for r in doc["steps"]:
        if "error" not in r:
            rows.append([f"{r['model']}, one layer × {r['T']} steps{', states kept' if r['save_states'] else ''}",
                         mb(r["peak_any"]), mb(r["peak_over_baseline"]), None, None])
    for r in doc["load"]:
        if "error" not in r:
            rows.append([f"load {r['model']}", mb(r["peak"]), mb(r["peak_over_baseline"]),
                         f"1.5 × float32 parameters, {mb(r['bound'])}", f"{r['ratio_over_baseline'] / 1.5:.2f}"])
    return benchdoc.markdown_table(("case", "peak RSS", "peak over the runtime baseline", "bound",
                                    "over baseline / bound"), rows)


def measure(args, argv) -> dict:
    """Every case, each in a fresh process, printed as it finishes; every number, as a dict."""
    if args.quick:
        args.model, args.prompt, args.steps, args.steps_prompt, args.loads = "minilm", 32, "2,4", 16, "minilm"
    Ts = [int(t) for t in args.steps.split(",")]
    doc = {"cpus": os.cpu_count(), "quick": args.quick, "argv": sys.argv[1:] if argv is None else list(argv),
           "run": None, "steps": [], "load": []}

    print(f"run: {args.model}, 1 x {args.prompt} tokens, every layer, rule paper, every measure (fresh process)")
    r = assess_run(spawn(dict(case="run", model=args.model, n=args.prompt), args.timeout))
    doc["run"] = r
    if "error" in r:
        print(f"  error: {r['error']}")
    else:
        a = r["activation_floats"]
        print(f"  one layer's activations: {fmt(r['layer_activation_bytes'])} MB (scores H n^2 {fmt(r['scores_bytes'])} MB; "
              f"n d {fmt(4 * a['tokens_in'])} MB, qkv {fmt(4 * a['qkv'])} MB, head out {fmt(4 * a['head_out'])} MB)")
        print(f"  {'MB':>44} {'':>3}")
        print(f"  runtime baseline (imports, backend)        {fmt(r['baseline_rss'])}")
        print(f"  float32 parameters                         {fmt(r['param_bytes'])}")
        print(f"  RSS before the run (model, prompt, bases)  {fmt(r['before'])}")
        print(f"  first call (compile + run): peak           {fmt(r['first_peak'])}   ({r['first_seconds']:.1f} s), "
              f"increment {fmt(r['first_increment']).strip()}")
        print(f"  second call (compiled run): peak           {fmt(r['peak'])}   ({r['seconds']:.1f} s, "
              f"{r['steps']} steps, finite {r['finite']})")
        print(f"  peak over the baseline (either call)       {fmt(r['peak_over_baseline'])}")
        print(f"  first call's increment / one layer's activations: "
              f"{r['first_increment'] / r['layer_activation_bytes']:.2f}; second call's increment over the RSS "
              f"the first left (the allocator keeps what it freed) {fmt(r['run_increment']).strip()} MB")
        print(f"  bound: parameters + 4 x activations        {fmt(r['bound'])}")
        print(f"  below the bound: absolute {r['below_bound_absolute']} "
              f"(peak / bound {r['peak_any'] / r['bound']:.2f}; compiled run alone {r['peak'] / r['bound']:.2f}), "
              f"over baseline {r['below_bound_over_baseline']} ({r['peak_over_baseline'] / r['bound']:.2f})")

    print(f"\nsteps: {args.model} layer {args.steps_layer} shared, 1 x {args.steps_prompt} tokens, every measure")
    print(f"  {'T':>6} {'states':>6} {'peak MB':>9} {'run incr. MB':>13} {'1st incr. MB':>13} {'s':>7}")
    cases = [(T, False) for T in Ts] + [(max(Ts), True)]
    for T, keep in cases:
        r = assess_run(spawn(dict(case="steps", model=args.model, n=args.steps_prompt, T=T, layer=args.steps_layer,
                                  save_states=keep), args.timeout))
        doc["steps"].append(r)
        if "error" in r:
            print(f"  {T:>6} {str(keep):>6} error: {r['error']}")
            continue
        print(f"  {T:>6} {str(keep):>6} {fmt(r['peak'])} {fmt(r['run_increment']):>13} "
              f"{fmt(r['first_increment']):>13} {r['seconds']:7.2f}")
    ok = [r for r in doc["steps"] if "error" not in r and not r["save_states"]]
    if len(ok) >= 2:
        # growth is read from the first call of each fresh process (compile + run: the compiler's
        # share is the same for every T), and from its absolute peak; the second call's increment
        # is over an RSS that already holds what the first call's run freed
        states = [r for r in doc["steps"] if "error" not in r and r["save_states"]]
        expect = (max(Ts) + 1) * args.steps_prompt * ok[0]["d_model"] * 4
        g = {"from_T": ok[0]["T"], "to_T": ok[-1]["T"],
             "first_increment_growth": ok[-1]["first_increment"] - ok[0]["first_increment"],
             "peak_growth": ok[-1]["peak_any"] - ok[0]["peak_any"],
             "states_kept_first_increment_growth": (states[0]["first_increment"] - ok[-1]["first_increment"])
             if states else None, "states_bytes_expected": expect}
        doc["steps_growth"] = g
        print(f"  from T={g['from_T']} to T={g['to_T']}: first-call increment {g['first_increment_growth'] / MB:+.1f} MB, "
              f"peak {g['peak_growth'] / MB:+.1f} MB")
        if states:
            print(f"  control, states kept at T={max(Ts)}: first-call increment "
                  f"{g['states_kept_first_increment_growth'] / MB:+.1f} MB over the same run without them "
                  f"(the states alone, (T+1) n d x 4 B: {expect / MB:.1f} MB)")

    print("\nload: peak RSS of pl.load(name) (fresh process)")
    print(f"  {'model':<9} {'params MB':>9} {'baseline':>9} {'peak':>9} {'peak-base':>9} {'1.5x par':>9} "
          f"{'ratio':>6} {'ok':>5} {'s':>6}")
    for name in [m for m in args.loads.split(",") if m]:
        r = assess_load(spawn(dict(case="load", model=name), args.timeout))
        doc["load"].append(r)
        if "error" in r:
            print(f"  {name:<9} error: {r['error']}")
            continue
        print(f"  {name:<9} {fmt(r['param_bytes'])} {fmt(r['baseline_rss'])} {fmt(r['peak'])} "
              f"{fmt(r['peak_over_baseline'])} {fmt(r['bound'])} {r['ratio_over_baseline']:6.2f} "
              f"{str(r['below_bound_over_baseline']):>5} {r['seconds']:6.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
        print(f"\nwrote {args.json}")
    return doc


if __name__ == "__main__":
    main()
