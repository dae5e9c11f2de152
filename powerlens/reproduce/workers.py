"""``reproduce --jobs N``: the real-model chunks computed in worker processes.

Sections 5-8 spend most of their time per model: loading it, the spectra of its layers
and compiling the scans for its shapes, most of that single-threaded. Each section lists
its chunks of one model with ``section.model_chunks(ctx, name)`` -> [(key, compute)], so a
worker can compute every chunk of one model ahead of the section that reads it. The
workers write into the same :class:`~powerlens.sweeps.store.ChunkFolder` as the main
process (atomic writes, one model per worker, so no two processes write one chunk); when a
section reaches a model, :meth:`Context.model_chunk` waits for that model's worker and then
reads its chunks back through the store, as a resumed run does. The numbers are therefore
those of a serial run, whatever N. A worker that fails or dies leaves its model to the main
process, which computes what is missing and reports any error in the section, as ``--jobs 1``
would.

By default every real model gets its own worker, up to two per core: on 2 cores the three
default models then share the cores and finish together (measured: three workers finished
``--quick`` sooner than two, where the third model waited for a free one). Models go to the
workers largest first (by the bytes of their files), so the longest ones start at once.
Workers that fill the cores run XLA and BLAS single-threaded (:func:`worker_env`).
"""
from __future__ import annotations

import concurrent.futures as futures
import contextlib
import multiprocessing
import os
import sys
from typing import Callable, Dict, List, Optional, Sequence


def worker_env(n: int) -> dict:
    """The workers' environment: :func:`powerlens.sweeps.distributed.worker_env` (single-threaded
    XLA when the workers fill the cores), and single-threaded BLAS then too. It starts from the
    user's environment, not from the one thread :func:`single_threaded_main` gave this process."""
    from ..sweeps.distributed import worker_env as xla_env
    base = dict(os.environ)
    if _USER_ENV:
        for key, value in _USER_ENV[0].items():
            if value is None:
                base.pop(key, None)
            else:
                base[key] = value
    env = xla_env(n, cores(), base)
    if env.get("XLA_FLAGS") != base.get("XLA_FLAGS"):
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


_USER_ENV: List[Dict[str, Optional[str]]] = []    # XLA_FLAGS and XLA_THREADS before single_threaded_main


def single_threaded_main(env: dict) -> bool:
    """Ask for this process's XLA on one thread before its CPU backend starts, in the
    environment ``env`` (a dict, changed in place; the ``reproduce`` command gives its own
    ``os.environ``): ``XLA_FLAGS`` += ``SINGLE_THREAD_XLA`` and ``XLA_THREADS`` = 1, which
    :func:`~powerlens.sweeps.distributed.start_xla` acts on once the workers have started.
    True when that is set (or the user's XLA_FLAGS or XLA_THREADS already choose the threads,
    which then win); False when a backend had already started.

    The numbers of sections 1-4 depend, in the last bits, on XLA's thread settings (the model
    sections do not), so the same setting everywhere makes results.json the same bytes
    whatever ``--jobs`` and whatever the machine's cores; and while the workers keep the cores
    busy, threads here would only compete with them."""
    from ..dynamics.execution import backends_initialized
    from ..sweeps.distributed import XLA_THREADS, chooses_threads, same_numbers_xla
    flags = env.get("XLA_FLAGS")
    if _USER_ENV or chooses_threads(flags or "", env):
        return True
    if backends_initialized():
        return False
    _USER_ENV.append({"XLA_FLAGS": flags, XLA_THREADS: None})
    same_numbers_xla(env)                            # XLA_FLAGS += SINGLE_THREAD_XLA
    env[XLA_THREADS] = "1"
    return True


def worker_main(env: dict) -> None:
    """A worker process's entry point (the pool's initializer, before any task): its
    environment becomes ``env`` (:func:`worker_env`), then its XLA starts, on one thread when
    ``env`` asks for it (the workers fill the cores)."""
    from ..sweeps.distributed import start_xla
    os.environ.clear()
    os.environ.update(env)
    start_xla()


def cores() -> int:
    """The cores this process may run on (``os.sched_getaffinity`` where the platform has it)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:
        return max(os.cpu_count() or 1, 1)


def check_jobs(jobs) -> Optional[int]:
    """``--jobs``: None (the default: one worker per real model, at most 2 per core) or N >= 1
    (1: no workers, everything in the main process)."""
    if jobs is None:
        return None
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"--jobs must be a positive integer, got {jobs!r}")
    return jobs


def model_bytes(name: str) -> int:
    """The size on disk of model ``name`` (0 when it cannot be found): the order of the work."""
    from ..models.load import resolve
    try:
        path = resolve(name)
    except ValueError:
        return 0
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def chunks_of(ctx, sections: Sequence[Callable], name: str) -> List[tuple]:
    """(key, compute) of every chunk of model ``name`` in ``sections``, in the report's order."""
    return [c for s in sections if hasattr(s, "model_chunks") for c in s.model_chunks(ctx, name)]


def _compute_model(out: str, settings: dict, quick: bool, seed: int, models: List[str], section_names: List[str],
                   name: str) -> List[str]:
    """Worker: compute the missing chunks of ``name``; returns the keys it computed."""
    from . import Context, all_sections
    from ..sweeps.store import ChunkFolder
    store = ChunkFolder(out, settings)
    ctx = Context(out=out, store=store, quick=quick, seed=seed, models=models, show_progress=False)
    sections = [s for s in all_sections() if s.__name__ in section_names]
    computed = []
    for key, compute in chunks_of(ctx, sections, name):
        before = store.computed
        store.cached(key, compute)
        if store.computed > before:
            computed.append(key)
    return computed


def start_method() -> str:
    """How the workers start: ``fork`` on Linux while no JAX backend has started in this process
    (a forked worker inherits the imported modules, about 2.7 s of CPU each otherwise, and
    starts its own backend, with the environment of :func:`worker_env`); ``spawn`` otherwise
    (a started XLA backend has threads, which a fork would not carry over)."""
    from ..dynamics.execution import backends_initialized
    if sys.platform.startswith("linux") and not backends_initialized():
        return "fork"
    return "spawn"


@contextlib.contextmanager
def model_workers(ctx, sections: Sequence[Callable], settings: dict, jobs: int):
    """Start up to ``jobs`` worker processes on the real models of ``sections`` (none when
    ``jobs`` is 1 or no section has model chunks) and register them in ``ctx.pending``;
    the pool is shut down on exit (a worker still running is cancelled or waited for)."""
    jobs = check_jobs(jobs)
    with_chunks = [s for s in sections if hasattr(s, "model_chunks")]
    names: List[str] = []
    if jobs != 1 and with_chunks:
        from .real_models import available_models
        found, _ = available_models(ctx)
        names = [n for n in found if chunks_of(ctx, with_chunks, n)]
    if not names or jobs == 1:
        yield {}
        return
    names.sort(key=model_bytes, reverse=True)
    n = min(len(names), 2 * cores() if jobs is None else jobs)
    pool = futures.ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context(start_method()),
                                       initializer=worker_main, initargs=(worker_env(n),))
    try:
        pending: Dict[str, futures.Future] = {
            m: pool.submit(_compute_model, ctx.out, settings, ctx.quick, ctx.seed, list(ctx.models),
                           [s.__name__ for s in with_chunks], m) for m in names}
        ctx.pending.update(pending)
        yield pending
    finally:
        ctx.pending.clear()
        pool.shutdown(wait=True, cancel_futures=True)
