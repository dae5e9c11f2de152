"""A second ``pl.trace`` of the same model: the spectra come from the per-model cache.

    python benchmarks/trace_cache.py [--repeat 5]

In one process: SmolLM2 is loaded, then ``pl.trace(model, PROMPTS)`` (2 prompts, rule ``full``)
runs once (it compiles the forward and computes the 30 layers' spectra), then ``--repeat``
more times; the table gives the first call, the median of the later ones and their ratio
(the target: at most 0.1, i.e. 10x faster). For comparison it also times what a call is made
of: the spectra alone (``spectra_of`` on a copy of the weights, so nothing is cached) and a
trace given its ``spectra=`` (the forward and the measures alone). The load average is noted,
since other work on the machine stretches every time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchdoc  # noqa: E402

PROMPTS = ["The capital of France is", "Power iteration finds the dominant eigenvector of a matrix."]
TARGET = 0.1


def _timed(fn):
    """(wall seconds, the value); the CPU seconds of this process go to ``_timed.cpu``."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    _timed.cpu = time.process_time() - c0
    return time.perf_counter() - t0, out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="later calls to time (default 5)")
    benchdoc.add_doc_option(ap, "trace_cache")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import powerlens as pl
    from powerlens._src.analysis.spectra import spectra_of

    with benchdoc.Capture() as printed:
        load0 = os.getloadavg()
        print(f"load average at the start (1, 5, 15 min): {', '.join(f'{v:.2f}' for v in load0)}")
        t_load, model = _timed(lambda: pl.load("smollm2"))
        print(f"load smollm2: {t_load:.2f} s")

        def trace(**kw):
            tr = pl.trace(model, PROMPTS, **kw)
            jax.block_until_ready(tr.states)
            return tr

        first, tr = _timed(trace)
        first_cpu = _timed.cpu
        later, later_cpu = [], []
        for _ in range(args.repeat):
            later.append(_timed(trace)[0])
            later_cpu.append(_timed.cpu)
        second, second_cpu = statistics.median(later), statistics.median(later_cpu)
        print(f"first pl.trace: {first:.3f} s (CPU {first_cpu:.3f} s); later calls: "
              f"{', '.join(f'{t:.3f}' for t in later)} s (CPU median {second_cpu:.3f} s)")
        # what a call is made of: the spectra of fresh (copied) weights, and the trace given them
        copy = model.layers.replace(W_o=jnp.array(model.layers.W_o, copy=True))
        t_spectra = _timed(lambda: spectra_of(copy))[0]
        c_spectra = _timed.cpu
        t_forward = statistics.median(_timed(lambda: trace(spectra=tr.spectra))[0] for _ in range(args.repeat))
        ratio = second / first
        met = ratio <= TARGET
        print(f"spectra alone (uncached, {len(tr.spectra)} layers): {t_spectra:.3f} s (CPU {c_spectra:.3f} s); "
              f"trace with spectra= given: {t_forward:.3f} s")
        print(f"ratio second / first = {ratio:.4f} ({1 / ratio:.0f}x faster); target <= {TARGET}: "
              f"{'met' if met else 'NOT met'}")
        load1 = os.getloadavg()
        print(f"load average at the end: {', '.join(f'{v:.2f}' for v in load1)}")
        assert np.isfinite(np.asarray(tr.logits)).all()
    table = benchdoc.markdown_table(
        ("call", "wall s", "over the first call", "CPU s (this process)"),
        [["first `pl.trace(smollm2, 2 prompts)` (compiles, computes the spectra)", f"{first:.3f}", "1",
          f"{first_cpu:.3f}"],
         [f"later calls (median of {args.repeat}; spectra from the cache)", f"{second:.3f}",
          f"{ratio:.4f} ({'meets' if met else 'misses'} ≤ {TARGET})", f"{second_cpu:.3f}"],
         ["for comparison: the 30 spectra alone, uncached", f"{t_spectra:.3f}", f"{t_spectra / first:.4f}",
          f"{c_spectra:.3f}"],
         ["for comparison: a trace given `spectra=` (the forward)", f"{t_forward:.3f}", f"{t_forward / first:.4f}",
          "–"]])
    notes = [f"One process; {os.cpu_count()} cores; load average "
             f"{', '.join(f'{v:.2f}' for v in load0)} at the start, {', '.join(f'{v:.2f}' for v in load1)} at the end "
             "(other work on the machine stretches wall times). The first call includes compiling the forward."]
    benchdoc.write_if_asked(args, "trace_cache", argv, [table], printed.text, notes=notes, packages=("gguf",),
                            summary="A second `pl.trace` of the same model takes its spectra from the per-model "
                                    "cache: its wall time over the first call's.")
    return {"first": first, "second": second, "ratio": ratio, "spectra": t_spectra, "forward": t_forward,
            "first_cpu": first_cpu, "second_cpu": second_cpu}


if __name__ == "__main__":
    main()
