"""How long the command line takes to answer, and how much of it is importing modules.

    python benchmarks/startup.py [--repeat 5] [--text "..."]

Each command runs ``--repeat`` times, each time in a fresh process; the table gives the
median wall time, the median CPU time (user + system of the child process, from
``resource.getrusage(RUSAGE_CHILDREN)``) and the import share: the median time those
processes spent importing modules (the top-level entries of ``python -X importtime``, from
as many further runs) and its fraction of the wall time. ``align minilm`` runs cold, with an
empty compilation cache (``POWERLENS_CACHE`` pointing to a new temporary folder), then warm,
a second run with that folder; ``spectrum minilm`` runs with a warm cache. The targets:
``--help``, a usage error, a bad option value and a missing file under 0.5 s (the last two
are refused before any numerical library is imported), a warm one-prompt ``align`` under
2.5 s on a quiet 2-core machine. The machine's load average is noted beside every time, since
other work on the machine stretches wall times; CPU time is the stable number on a busy machine
(the verdict is given for both).
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

# name -> (argv after `powerlens`, the cache it runs with, its target in seconds or None, its exit status)
CASES = {
    "--help": (["--help"], "none", 0.5, 0),
    "usage error (simulate, no options)": (["simulate"], "none", 0.5, 2),
    "bad value (simulate --steps 0)": (["simulate", "--spectrum", "2,1", "--steps", "0", "--out", "{out}"],
                                       "none", 0.5, 2),
    "missing file (align --prompts)": (["align", "minilm", "--prompts", "{missing}", "--out", "{out}"],
                                       "none", 0.5, 2),
    "align minilm, cold": (["align", "minilm", "--text", "{text}", "--out", "{out}"], "cold", None, 0),
    "align minilm, warm": (["align", "minilm", "--text", "{text}", "--out", "{out}"], "warm", 2.5, 0),
    "spectrum minilm": (["spectrum", "minilm", "--out", "{out}"], "warm", None, 0),
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


def run_once(argv: Sequence[str], cache: Optional[str], *, importtime: bool, text: str,
             expected: int = 0) -> Dict[str, float]:
    """One fresh process (exiting with ``expected``): wall and CPU seconds (its user + system
    time, ``RUSAGE_CHILDREN``), and the import seconds when ``importtime``."""
    out = tempfile.mkdtemp(prefix="powerlens-out-")
    args = [a.format(text=text, out=os.path.join(out, "result"), missing=os.path.join(out, "missing.txt"))
            for a in argv]
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), *powerlens_script(), *args]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=child_env(cache))
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    shutil.rmtree(out, ignore_errors=True)
    if r.returncode != expected:
        raise SystemExit(f"benchmarks/startup.py: `powerlens {' '.join(args)}` exited with {r.returncode}:\n"
                         f"{r.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "imports": import_seconds(r.stderr) if importtime else float("nan")}


def measure(argv: Sequence[str], cache_kind: str, *, repeat: int, text: str, expected: int = 0) -> Dict[str, float]:
    """Medians over ``repeat`` timed processes and ``repeat`` processes under ``-X importtime``.
    ``cache_kind``: "none" (a fresh empty cache each time; these commands compile nothing),
    "cold" (an empty cache each time), "warm" (a cache that one run of the command filled)."""
    timed, traced = [], []
    for kind, runs in (("timed", timed), ("traced", traced)):
        for _ in range(repeat):
            cache = tempfile.mkdtemp(prefix="powerlens-cache-")
            if cache_kind == "warm":
                run_once(argv, cache, importtime=False, text=text, expected=expected)
            runs.append(run_once(argv, cache, importtime=kind == "traced", text=text, expected=expected))
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


def verdict(seconds: float, target: Optional[float]) -> str:
    return "–" if target is None else f"yes (< {target:g} s)" if seconds < target else f"no (>= {target:g} s)"


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
        for name, (cmd, cache_kind, target, status) in CASES.items():
            load = load_average().split(",")[0]
            res = results[name] = measure(cmd, cache_kind, repeat=args.repeat, text=args.text, expected=status)
            met = verdict(res["wall"], target)
            if target is not None:
                met += f"; CPU {verdict(res['cpu'], target).split(' (')[0]}"
            shown = " ".join(f'"{args.text}"' if a == "{text}" else "DIR" if a == "{out}" else
                             "MISSING.txt" if a == "{missing}" else a for a in cmd)
            what = {"none": "" if not status else " (a usage error)" if "usage" in name else
                    " (a bad value)" if "value" in name else " (a missing file)",
                    "cold": " (cold cache)", "warm": " (warm cache)"}[cache_kind]
            rows.append([f"`powerlens {shown}`{what}", f"{res['wall']:.2f}", f"{res['cpu']:.2f}",
                         f"{res['imports']:.2f} ({res['share']:.0%})", load, met])
            print(f"{name:<36} wall {res['wall']:6.2f} s   cpu {res['cpu']:6.2f} s   "
                  f"imports {res['imports']:5.2f} s ({res['share']:.0%})   load {load}   target: {met}")
        end_load = load_average()
        print(f"load average at the end (1, 5, 15 min): {end_load}")
    table = benchdoc.markdown_table(["command", "wall s (median)", "CPU s (median)", "imports s (share of wall)",
                                     "load (1 min) at its start", "target met (wall; CPU)"], rows)
    notes = [f"Median of {args.repeat} fresh processes each on {benchdoc.cpu_name()}, {os.cpu_count()} cores; "
             f"load average {start_load} "
             f"(1, 5, 15 min) at the start, {end_load} at the end. Other work on the machine stretches wall "
             f"times (a load above the core count means processes waited for a core); CPU time, the process's "
             f"user + system time, does not wait, and is the stable number on a busy machine."]
    if os.nice(0):
        notes.append(f"The processes ran at niceness {os.nice(0)}.")
    notes.append("powerlens' bytecode was compiled before the runs (compileall), as an install does.")
    benchdoc.write_if_asked(args, "startup", argv, [table], printed.text,
                            summary="Wall time of the command line, and the share of it spent importing modules.",
                            packages=("scipy", "matplotlib", "tokenizers"), notes=notes)
    return results


if __name__ == "__main__":
    main()
