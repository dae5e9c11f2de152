"""Benchmark: loading the real checkpoints and computing every layer's spectrum.

For MiniLM (all-MiniLM-L6-v2, safetensors float32) and SmolLM2-135M-Instruct (Q4_1 GGUF,
dequantised to float32 on load) this prints, each number from a fresh Python process so
that nothing is cached or already allocated:

    cold load     ``import powerlens._src.models`` + ``load(name)`` in a new process (what a user
                  waits for; the OS file cache is whatever it is: the file was read before)
    load          ``load(name)`` alone in that new process (imports done first)
    warm load     a second ``load(name)`` in the same process
    peak RSS      growth of the peak resident set while loading, in a process whose imports
                  (and JAX's CPU client) are done first: VmHWM is reset through
                  /proc/self/clear_refs, so the peak counts the load alone; as a ratio to
                  the checkpoint file size and, for the quantised GGUF, to the float32 bytes
                  of the parameters it becomes
    spectra       ``powerlens._src.analysis.alignment.model_spectra(model)``: float64 eig + the
                  principal subspaces of every unique layer's F_t (first call, and a second)

    python benchmarks/models.py [--models minilm smollm2] [--threads 1]

BLAS threads are set by --threads (default 1: on a shared machine more threads make eig
slower, not faster). The target: peak memory while loading below 1.5x the file.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


# ------------------------------------------------------------------ child processes

def _status_kib(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False when not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _file_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    weights = [f for f in os.listdir(path) if f.endswith(".safetensors")] or \
              [f for f in os.listdir(path) if f.endswith(".bin")]
    return sum(os.path.getsize(os.path.join(path, f)) for f in weights)


def child_timing(name: str) -> dict:
    t0 = time.perf_counter()
    import powerlens._src.models as M
    t1 = time.perf_counter()
    model = M.load(name)
    t2 = time.perf_counter()
    del model
    t3 = time.perf_counter()
    model = M.load(name)
    t4 = time.perf_counter()
    from powerlens._src.analysis.alignment import model_spectra
    t5 = time.perf_counter()
    spectra = model_spectra(model)
    t6 = time.perf_counter()
    model_spectra(model)
    t7 = time.perf_counter()
    cfg = model.layers.config
    return {"cold_load_s": t2 - t0, "import_s": t1 - t0, "load_s": t2 - t1, "warm_load_s": t4 - t3,
            "spectra_s": t6 - t5, "spectra_again_s": t7 - t6, "layers": len(spectra), "d": cfg.d_model}


def child_memory(name: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import powerlens._src.models as M
    from powerlens._src.models import families  # noqa: F401  (converters)
    from powerlens._src.models import gguf_llama, reader  # noqa: F401  (GGUF and safetensors readers)
    import gguf  # noqa: F401
    import safetensors.numpy  # noqa: F401
    jnp.zeros(8).block_until_ready()                    # start JAX's CPU client before the baseline
    path = M.resolve(name)
    reset = _reset_peak()
    rss0 = _status_kib("VmRSS")
    hwm0 = _status_kib("VmHWM")
    model = M.load(name)
    jax.block_until_ready(jax.tree_util.tree_leaves(model))
    hwm1 = _status_kib("VmHWM")
    rss1 = _status_kib("VmRSS")
    leaves = jax.tree_util.tree_leaves(model)
    n_params = int(sum(np.size(a) for a in leaves))
    base = rss0 if reset else hwm0
    return {"file_bytes": _file_bytes(path), "peak_growth_bytes": (hwm1 - base) * 1024,
            "rss_growth_bytes": (rss1 - rss0) * 1024, "params": n_params, "param_bytes_f32": 4 * n_params,
            "peak_reset": reset, "quantised": path.endswith(".gguf")}


def run_child(mode: str, name: str, threads: int) -> dict:
    env = dict(os.environ)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, name],
                       capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{mode} run for {name} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ parent

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["minilm", "smollm2"])
    ap.add_argument("--threads", type=int, default=1, help="BLAS threads in the measured processes")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "MODEL"), help=argparse.SUPPRESS)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import benchdoc
    benchdoc.add_doc_option(ap, "models")
    args = ap.parse_args(argv)
    if args.child:
        mode, name = args.child
        print(json.dumps(child_timing(name) if mode == "timing" else child_memory(name)))
        return
    with benchdoc.Capture() as printed:
        rows = measure(args)
    mib = 1024.0 ** 2
    table = benchdoc.markdown_table(
        ("model", "file", "parameters", "cold load", "load", "warm load", "peak RSS while loading",
         "peak / file", "peak / float32 parameters", "layers", "spectra"),
        [[name, f"{m['file_bytes'] / mib:.1f} MiB", f"{m['params'] / 1e6:.1f} M", f"{t['cold_load_s']:.2f} s",
          f"{t['load_s']:.2f} s", f"{t['warm_load_s']:.2f} s", f"{m['peak_growth_bytes'] / mib:.1f} MiB",
          f"{m['peak_growth_bytes'] / m['file_bytes']:.2f}",
          f"{m['peak_growth_bytes'] / m['param_bytes_f32']:.2f}" if m["quantised"] else None,
          t["layers"], f"{t['spectra_s']:.2f} s"] for name, t, m in rows])
    benchdoc.write_if_asked(args, "models", argv, [table], printed.text, packages=("safetensors", "gguf"),
                            summary="Loading the real checkpoints and computing every layer's spectrum, each "
                                    "number from a fresh process (the script's docstring defines each column).")
    return rows


def measure(args):
    """[(model, timing child's numbers, memory child's numbers)], printed as a table."""
    rows = []
    for name in args.models:
        t = run_child("timing", name, args.threads)
        m = run_child("memory", name, args.threads)
        rows.append((name, t, m))
    mib = 1024.0 ** 2
    print(f"backend CPU, {os.cpu_count()} cpus, BLAS threads {args.threads}; each column from a fresh process")
    head = (f"{'model':>8} {'file MiB':>8} {'params':>8} {'cold load s':>11} {'load s':>7} {'warm s':>7} "
            f"{'peak RSS MiB':>12} {'/file':>6} {'/f32':>6} {'layers':>6} {'spectra s':>9} {'again s':>8}")
    print(head)
    print("-" * len(head))
    for name, t, m in rows:
        f32 = f"{m['peak_growth_bytes'] / m['param_bytes_f32']:6.2f}" if m["quantised"] else f"{'-':>6}"
        print(f"{name:>8} {m['file_bytes'] / mib:8.1f} {m['params'] / 1e6:7.1f}M {t['cold_load_s']:11.2f} "
              f"{t['load_s']:7.2f} {t['warm_load_s']:7.2f} {m['peak_growth_bytes'] / mib:12.1f} "
              f"{m['peak_growth_bytes'] / m['file_bytes']:6.2f} {f32} {t['layers']:6d} {t['spectra_s']:9.2f} "
              f"{t['spectra_again_s']:8.2f}")
    print("peak RSS = growth of VmHWM during load(); /file = that over the checkpoint size (target < 1.5); "
          "/f32 = over the float32 bytes of the dequantised parameters")
    if not all(m["peak_reset"] for _, _, m in rows):
        print("note: /proc/self/clear_refs was not writable: the peak is measured from the import-time peak")
    return rows


if __name__ == "__main__":
    main()
