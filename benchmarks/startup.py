"""How long the command line takes to answer, and how much of it is importing modules.

    python benchmarks/startup.py [--repeat 5] [--text "..."]

Each command runs ``--repeat`` times, each time in a fresh process; the table gives the
median wall time, the median CPU time (user + system) and the import share: the median time
those processes spent importing modules (the top-level entries of ``python -X importtime``,
from as many further runs) and its fraction of the wall time. ``align minilm`` runs cold,
with an empty compilation cache (``POWERLENS_CACHE`` pointing to a new temporary folder),
then warm, a second run with that folder; ``spectrum minilm`` runs with a warm cache. The
targets: ``--help`` and a usage error under 0.5 s, a warm one-prompt ``align`` under 3 s.
The load average of the machine is noted, since other work on it stretches every time.
powerlens' bytecode is compiled first (``compileall``), as installing a package does, so that
no timed process compiles a module that changed since the last run (with
``PYTHONDONTWRITEBYTECODE`` set, an editable install would compile those in every process).
"""
from __future__ import annotations

import argparse
import compileall
import importlib.util
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchdoc  # noqa: E402

TEXT = "The cat sat on the mat."

# name -> (argv after `powerlens`, the cache it runs with, its target in seconds or None)
CASES = {
    "--help": (["--help"], "none", 0.5),
    "usage error (simulate, no options)": (["simulate"], "none", 0.5),
    "align minilm, cold": (["align", "minilm", "--text", "{text}", "--out", "{out}"], "cold", None),
    "align minilm, warm": (["align", "minilm", "--text", "{text}", "--out", "{out}"], "warm", 3.0),
    "spectrum minilm": (["spectrum", "minilm", "--out", "{out}"], "warm", None),
}

_IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+(\d+) \| (\S.*)$")


def powerlens_script() -> List[str]:
    """The ``powerlens`` console script beside this interpreter, run by it (so that
    ``-X importtime`` can go in front); ``-m powerlens.cli`` where there is none."""
    script = os.path.join(os.path.dirname(sys.executable), "powerlens")
    return [script] if os.path.isfile(script) else ["-m", "powerlens.cli"]


def import_seconds(stderr: str) -> float:
    """Seconds spent importing: the sum of the cumulative times of the top-level imports
    (those not nested in another) that ``-X importtime`` wrote to ``stderr``."""
    return sum(int(m.group(1)) for m in map(_IMPORT_LINE.match, stderr.splitlines()) if m) / 1e6


def child_env(cache: Optional[str]) -> Dict[str, str]:
    """The environment of a timed process: the user's, with powerlens' cache in ``cache``
    (a folder of its own when None, so that nothing is read from the user's) and no
    compilation cache chosen from outside."""
    outside = ("JAX_COMPILATION_CACHE_DIR", "POWERLENS_XLA_CACHE", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    env = {k: v for k, v in os.environ.items() if k not in outside}
    env["POWERLENS_CACHE"] = cache or tempfile.mkdtemp(prefix="powerlens-cache-")
    return env


def run_once(argv: Sequence[str], cache: Optional[str], *, importtime: bool, text: str) -> Dict[str, float]:
    """One fresh process: wall and CPU seconds, and the import seconds when ``importtime``."""
    out = tempfile.mkdtemp(prefix="powerlens-out-")
    args = [a.format(text=text, out=os.path.join(out, "result")) for a in argv]
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), *powerlens_script(), *args]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=child_env(cache))
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    shutil.rmtree(out, ignore_errors=True)
    expected = 2 if argv == ["simulate"] else 0
    if r.returncode != expected:
        raise SystemExit(f"benchmarks/startup.py: `powerlens {' '.join(args)}` exited with {r.returncode}:\n"
                         f"{r.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "imports": import_seconds(r.stderr) if importtime else float("nan")}


def measure(argv: Sequence[str], cache_kind: str, *, repeat: int, text: str) -> Dict[str, float]:
    """Medians over ``repeat`` timed processes and ``repeat`` processes under ``-X importtime``.
    ``cache_kind``: "none" (a fresh empty cache each time; these commands compile nothing),
    "cold" (an empty cache each time), "warm" (a cache that one run of the command filled)."""
    timed, traced = [], []
    for kind, runs in (("timed", timed), ("traced", traced)):
        for _ in range(repeat):
            cache = tempfile.mkdtemp(prefix="powerlens-cache-")
            if cache_kind == "warm":
                run_once(argv, cache, importtime=False, text=text)
            runs.append(run_once(argv, cache, importtime=kind == "traced", text=text))
            shutil.rmtree(cache, ignore_errors=True)
    wall = statistics.median(r["wall"] for r in timed)
    imports = statistics.median(r["imports"] for r in traced)
    return {"wall": wall, "cpu": statistics.median(r["cpu"] for r in timed), "imports": imports,
            "share": imports / statistics.median(r["wall"] for r in traced)}


def compile_bytecode() -> str:
    """Write the bytecode of powerlens' modules (``compileall``, whatever
    ``PYTHONDONTWRITEBYTECODE`` says), as an install does; returns the package folder."""
    folder = importlib.util.find_spec("powerlens").submodule_search_locations[0]
    compileall.compile_dir(folder, quiet=1)
    return folder


def load_average() -> str:
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:                     # pragma: no cover - not on every platform
        return "unknown"


def main(argv=None) -> Dict[str, Dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="fresh processes per command and per measure (default 5)")
    ap.add_argument("--text", default=TEXT, help=f"the one prompt of align (default {TEXT!r})")
    benchdoc.add_doc_option(ap, "startup")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat must be a positive integer, got {args.repeat}")
    results, rows = {}, []
    compile_bytecode()
    with benchdoc.Capture() as printed:
        start_load = load_average()
        print(f"load average at the start (1, 5, 15 min): {start_load}")
        for name, (cmd, cache_kind, target) in CASES.items():
            res = results[name] = measure(cmd, cache_kind, repeat=args.repeat, text=args.text)
            met = ("–" if target is None else f"yes (< {target:g} s)" if res["wall"] < target
                   else f"no (>= {target:g} s)")
            shown = " ".join(f'"{args.text}"' if a == "{text}" else "DIR" if a == "{out}" else a for a in cmd)
            what = {"none": " (a usage error)" if "usage" in name else "", "cold": " (cold cache)",
                    "warm": " (warm cache)"}[cache_kind]
            rows.append([f"`powerlens {shown}`{what}",
                         f"{res['wall']:.2f}", f"{res['cpu']:.2f}", f"{res['imports']:.2f} ({res['share']:.0%})", met])
            print(f"{name:<36} wall {res['wall']:6.2f} s   cpu {res['cpu']:6.2f} s   "
                  f"imports {res['imports']:5.2f} s ({res['share']:.0%})   target: {met}")
        end_load = load_average()
        print(f"load average at the end (1, 5, 15 min): {end_load}")
    table = benchdoc.markdown_table(["command", "wall s (median)", "CPU s (median)", "imports s (share of wall)",
                                     "target met"], rows)
    notes = [f"Median of {args.repeat} fresh processes each; {os.cpu_count()} cores; load average "
             f"{start_load} at the start, {end_load} at the end (other work on the machine stretches wall times)."]
    if os.nice(0):
        notes.append(f"The processes ran at niceness {os.nice(0)}.")
    notes.append("powerlens' bytecode was compiled before the runs (compileall), as an install does.")
    benchdoc.write_if_asked(args, "startup", argv, [table], printed.text,
                            summary="Wall time of the command line, and the share of it spent importing modules.",
                            packages=("scipy", "matplotlib", "tokenizers"), notes=notes)
    return results


if __name__ == "__main__":
    main()
