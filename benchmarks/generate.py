"""Generation with a key/value cache: ``pl.generate`` against transformers' ``generate`` (its own
cache, ``do_sample=False``) on SmolLM2-135M, in one process.

    python benchmarks/generate.py [--repeat 5] [--new 128] [--prompt 16] [--threads 1]

Both sides read the same GGUF file in float32 (transformers through its GGUF loader), run on
the same number of threads (default all cores: torch's intra-op threads = the CPU count, which
XLA's CPU client uses too; ``--threads 1``: one each, XLA's Eigen pool switched off) and
decode the same 1 x ``--prompt`` token prompt greedily for ``--new`` tokens; the run first
checks that they emit the same tokens. Each side is warmed up (compilation, first calls), then
timed in turns, powerlens then transformers, ``--repeat`` times; the table gives each side's
median and best wall time, its median CPU time (the process's, all threads), tokens per second,
and the ratio transformers / powerlens of the median wall times (> 1: powerlens is faster). The
machine's load average is read before and after every timed call and printed beside the times,
since a loaded machine slows both sides unevenly.
``--tiny`` runs a tiny random Llama instead (no files, no results file unless ``--doc``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchdoc  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = ("Power iteration finds the top eigenvector of a matrix by multiplying a vector by it again and again, "
        "and normalising after every step.")


def load_pair(tiny: bool):
    """(powerlens's model, transformers' model of the same weights, float32)."""
    import torch
    import transformers as tf

    import powerlens as pl
    if tiny:
        import tempfile
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import hf_tiny_decoders as T
        folder = tempfile.mkdtemp(prefix="powerlens-generate-")
        hf = T.build("llama", folder, seed=1, max_position_embeddings=512)
        return pl.load(folder), hf.eval()
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from gguf_reference import gguf_parsed_once_in_memory
    path = pl.resolve("smollm2")
    with gguf_parsed_once_in_memory():
        hf = tf.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch.float32)
    return pl.load("smollm2"), hf.eval()


def prompt_of(model, length: int, tiny: bool):
    """A prompt of exactly ``length`` token ids: the start of :data:`TEXT` tokenized (random ids for --tiny)."""
    import numpy as np
    if tiny:
        return [int(t) for t in np.random.default_rng(0).integers(0, 61, length)]
    import powerlens as pl
    ids = pl.tokenize(model, [TEXT])[0]
    if len(ids) < length:
        raise SystemExit(f"the benchmark text has {len(ids)} tokens, fewer than --prompt {length}")
    return ids[:length]


def timed(fn):
    """(wall seconds, CPU seconds of the process, load average before, after, result) of one call."""
    before = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, before, os.getloadavg()[0], out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="timed calls per side, in turns (default 5)")
    ap.add_argument("--new", type=int, default=128, help="new tokens (default 128)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens (default 16)")
    ap.add_argument("--threads", type=int, choices=(0, 1), default=0,
                    help="threads per side: 0 (default) all cores, 1 one (XLA without its Eigen pool)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random Llama (tests)")
    benchdoc.add_doc_option(ap, "generate")
    args = ap.parse_args(argv)
    threads = args.threads or os.cpu_count() or 1
    if args.threads == 1:           # before JAX starts its CPU client
        if "jax" in sys.modules:
            raise SystemExit("--threads 1 must be set before JAX is imported (run the script in a fresh process)")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()
    import torch

    import powerlens as pl
    from powerlens._src.models.kv_cache import UNROLL_MIN_TOKENS
    torch.set_num_threads(threads)
    with benchdoc.Capture() as printed:
        model, hf = load_pair(args.tiny)
        ids = prompt_of(model, args.prompt, args.tiny)
        K = args.new
        pad = model.info.pad_token_id if model.info.pad_token_id is not None else 0

        def ours():
            return pl.generate(model, [ids], max_new_tokens=K).new_ids[0]

        def theirs():
            with torch.inference_mode():
                out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  do_sample=False, max_new_tokens=K, min_new_tokens=K, pad_token_id=pad,
                                  eos_token_id=None)
            return [int(t) for t in out[0, len(ids):]]

        t_first, _, _, _, a = timed(ours)
        b = theirs()
        same = a == b
        first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        print(f"{'tiny Llama' if args.tiny else 'SmolLM2-135M'}: 1 x {len(ids)} prompt, {K} new tokens, float32, "
              f"{threads} thread(s) per side on {os.cpu_count()} cores (torch threads {torch.get_num_threads()}); "
              f"first powerlens call (compiling) "
              f"{t_first:.2f} s")
        print(f"same tokens: {same}" + ("" if same else f" (first difference at new token {first_diff})"))
        times = {"powerlens": [], "transformers": []}
        cpu = {"powerlens": [], "transformers": []}
        loads = []
        for r in range(args.repeat):
            for name, fn in (("powerlens", ours), ("transformers", theirs)):
                dt, dc, l0, l1, _ = timed(fn)
                times[name].append(dt)
                cpu[name].append(dc)
                loads += [l0, l1]
                print(f"  turn {r + 1} {name:12s} {dt:7.3f} s  ({K / dt:6.1f} tokens/s)  CPU {dc:7.3f} s  "
                      f"load {l0:.2f} -> {l1:.2f}", flush=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
        ratio = med["transformers"] / med["powerlens"]
        load = f"{min(loads):.2f}-{max(loads):.2f}"
        print(f"median powerlens {med['powerlens']:.3f} s, transformers {med['transformers']:.3f} s: "
              f"ratio {ratio:.2f}x (> 1: powerlens faster); CPU time ratio "
              f"{med_cpu['transformers'] / med_cpu['powerlens']:.2f}x; load average {load} on {os.cpu_count()} cores")
    rows = [[name, f"{med[name]:.3f} s", f"{min(times[name]):.3f} s", f"{med_cpu[name]:.3f} s", f"{K / med[name]:.1f}",
             f"{med['transformers'] / med[name]:.2f}×"] for name in ("powerlens", "transformers")]
    table = benchdoc.markdown_table(("side", "median", "best", "CPU time (median)", "tokens/s (median)",
                                     "speed vs transformers"), rows)
    benchdoc.write_if_asked(
        args, "generate", argv, [table], printed.text, packages=("torch", "transformers", "gguf"),
        summary=(f"Greedy generation on {'a tiny random Llama' if args.tiny else 'SmolLM2-135M (Q4_1 GGUF, float32)'}, "
                 f"1 x {len(ids)} prompt, {K} new tokens: `pl.generate` (KV cache, one compiled loop; from "
                 f"{UNROLL_MIN_TOKENS} new tokens on a CPU its step is written out layer by layer, each layer's "
                 f"weights in buffers of their own; first call, compiling: {t_first:.1f} s) against "
                 f"transformers' `generate` with its cache, in one process, {threads} thread(s) per side, timed in "
                 f"turns; same tokens: {same}; load average {load} on {os.cpu_count()} cores during the timed calls."))
    return {"same": same, "median": med, "cpu": med_cpu, "ratio": ratio, "times": times,
            "load": [min(loads), max(loads)]}


if __name__ == "__main__":
    main()
