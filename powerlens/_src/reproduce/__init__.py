"""``powerlens reproduce``: every claim of the paper as a section with numbers, figures and a
computed verdict; results.json, report.md and a self-contained report.html.

Sweeps write finished chunks under ``OUT/.chunks/`` as they go; a killed run started
again with the same settings resumes from them and yields the same results.json.
A section that fails is reported as failed, the others are kept, and the command
exits non-zero.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Callable, List, Optional

from .. import io
from .context import Context, all_sections, stderr_is_tty  # noqa: F401  (re-exported)
from .section import SectionResult


def _announce(ctx: "Context", k: int, n: int, fn: Callable) -> None:
    """One line on stderr as section ``k`` of ``n`` starts (unless ``--quiet``)."""
    if not ctx.show_progress:
        return
    text = f"powerlens reproduce: section {k}/{n}: {getattr(fn, 'title', fn.__name__)}"
    if stderr_is_tty():
        from tqdm.auto import tqdm
        tqdm.write(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr, flush=True)


def run_sections(ctx: Context, sections) -> List[SectionResult]:
    results = []
    for k, fn in enumerate(sections, 1):
        _announce(ctx, k, len(sections), fn)
        t0 = time.time()
        try:
            res = fn(ctx)
        except Exception as exc:  # a failing section must not take the others down
            name = fn.__name__.replace("section_", "")
            res = SectionResult(name, getattr(fn, "title", name.replace("_", " ")), getattr(fn, "claim", ""), "failed",
                                f"This section failed: {type(exc).__name__}: {exc}",
                                error=traceback.format_exc(limit=8))
        res.figures = [ctx.rel(f) if os.path.isabs(f) else f for f in res.figures]
        res.seconds = time.time() - t0
        results.append(res)
    return results


def settings_difference(old: dict, new: dict) -> str:
    """``seed 0 -> 1, quick False -> True``: the keys whose values differ."""
    keys = sorted(set(old) | set(new))
    return ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k))


FILES = ("results.json", "report.md", "report.html")            # what a finished run writes ...
FOLDERS = (".chunks", "figures")      # ... beside its chunks and figures, each listed as written (io.claim)


def _settings_difference(old: dict, new: dict) -> str:
    difference = settings_difference(old, new)
    return f"a reproduce run with other settings ({difference})" if difference else ""


def prepare_folder(out: str, settings: dict, *, overwrite: bool) -> None:
    """Make ``out`` ready to resume into (call with the folder lock held).

    The rule is :func:`powerlens._src.io.decide_folder`'s: a folder of a ``reproduce`` run with the
    same settings is resumed; one written with other settings or by another command is refused,
    naming the difference, unless ``overwrite``, which first removes what powerlens wrote there;
    one holding anything powerlens did not write is refused either way. Runs with different
    settings therefore never mix their files.
    """
    action = io.decide_folder(out, command="reproduce", settings=settings, overwrite=overwrite,
                              resume=_settings_difference)
    if action == "replace":
        io.remove_owned(out)
    io.mark_resumable(out, "reproduce", settings, files=FILES, folders=FOLDERS)


def cmd_reproduce(args, *, worker_base_env: Optional[dict] = None) -> int:
    """``powerlens reproduce``. ``worker_base_env``: the environment the worker processes start
    from (default ``os.environ``; the command line gives the user's, from before it asked for
    one XLA thread in this process)."""
    settings = {"quick": bool(args.quick), "seed": int(args.seed), "models": list(args.models or []),
                "sections": sorted(args.sections) if getattr(args, "sections", None) else None}
    from .workers import check_jobs
    args.jobs = check_jobs(getattr(args, "jobs", None))
    out = io.check_out_path(args.out, command="reproduce")
    with io.folder_lock(out):
        prepare_folder(out, settings, overwrite=bool(getattr(args, "overwrite", False)))
        return _reproduce_into(out, settings, args, worker_base_env)


def _reproduce_into(out: str, settings: dict, args, worker_base_env: Optional[dict] = None) -> int:
    from ..sweeps.store import ChunkFolder
    from .report import render_html, render_markdown
    from .workers import model_workers
    store = ChunkFolder(out, settings)
    ctx = Context(out=out, store=store, quick=args.quick, seed=args.seed, models=list(args.models or []),
                  show_progress=not getattr(args, "quiet", False))
    sections = all_sections()
    if getattr(args, "sections", None):
        sections = [s for s in sections if any(k in s.__name__ for k in args.sections)]
    t0 = time.time()
    with model_workers(ctx, sections, settings, args.jobs, base_env=worker_base_env):   # starts this process's XLA
        results = run_sections(ctx, sections)
    full_settings = {**settings, "versions": io.versions()}
    doc = {"settings": settings, "sections": [r.to_json() for r in results]}
    written = [io.write_json(os.path.join(out, "results.json"), doc),
               io.write_text(os.path.join(out, "report.md"), render_markdown(results, full_settings)),
               io.write_text(os.path.join(out, "report.html"), render_html(results, full_settings, out))]
    failed = [r for r in results if r.verdict == "failed"]
    if not failed:
        store.clear()
    print(f"\npowerlens reproduce: {len(results)} sections in {time.time() - t0:.0f} s "
          f"({store.loaded} chunks resumed, {store.computed} computed)")
    for r in results:
        print(f"  [{r.verdict:>16}] {r.title} ({r.seconds:.0f} s)")
    figs = sorted({f for r in results for f in r.figures})
    print("files written:")
    for w in written:
        print(f"  {w}")
    print(f"  {len(figs)} figures under {os.path.join(out, 'figures')}")
    if failed:
        print(f"{len(failed)} section(s) failed: {', '.join(r.id for r in failed)} (see the report)")
        return 1
    return 0
