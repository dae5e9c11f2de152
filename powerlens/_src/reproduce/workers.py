"""``reproduce --jobs N``: the real-model chunks computed in worker processes.

Sections 5-8 spend most of their time per model: loading it, the spectra of its layers
and compiling the scans for its shapes, most of that single-threaded. Each section lists
its chunks of one model with ``section.model_chunks(ctx, name)`` -> [(key, compute)], so a
worker can compute every chunk of one model ahead of the section that reads it. The
workers write into the same :class:`~powerlens._src.sweeps.store.ChunkFolder` as the main
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
Workers that fill the cores run XLA and BLAS single-threaded
(:func:`powerlens._src.runtime.threads.worker_env`), starting from the user's environment.

The workers end with the main process (:mod:`powerlens._src.runtime.workers`: their own process
groups, SIGTERM and SIGHUP turned into an interruption that stops them, PR_SET_PDEATHSIG on
Linux); what they finished stays in the chunk folder, and the same command resumes from it.
Unless ``--quiet``, each worker reports its model, section and chunks (:class:`WorkerProgress`):
a bar per worker on a terminal, one line per section otherwise.

This module is the workers' entry point (:func:`worker_main`, :func:`compute_model`), and so
one of the few that import :mod:`powerlens._src.runtime`.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

from ..runtime.threads import available_cores, start_xla, worker_env


def worker_main(env: dict) -> None:
    """A worker process's entry point (the pool's initializer, before any task): its
    environment becomes ``env`` (:func:`~powerlens._src.runtime.threads.worker_env`), then its XLA
    starts, on one thread when ``env`` asks for it (the workers fill the cores)."""
    os.environ.clear()
    os.environ.update(env)
    start_xla()


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


def section_label(section: Callable) -> str:
    """A section's title (``7. Steering with ...``), or its name, cut to 40 characters."""
    label = getattr(section, "title", section.__name__.replace("section_", "").replace("_", " "))
    return label if len(label) <= 40 else label[:39] + "…"


def compute_model(out: str, settings: dict, quick: bool, seed: int, models: List[str], section_names: List[str],
                  name: str, report: Optional[Callable[[dict], None]] = None) -> List[str]:
    """Worker: compute the missing chunks of model ``name``; returns the keys it computed.
    ``report`` (a :class:`~powerlens._src.runtime.workers.Reporter`, or None) gets a message as
    the model starts, as each section starts and as each chunk is done."""
    from .context import Context, all_sections
    from ..sweeps.store import ChunkFolder
    store = ChunkFolder(out, settings)
    ctx = Context(out=out, store=store, quick=quick, seed=seed, models=models, show_progress=False)
    sections = [s for s in all_sections() if s.__name__ in section_names]
    plan = [(s, s.model_chunks(ctx, name)) for s in sections if hasattr(s, "model_chunks")]
    total = sum(len(chunks) for _, chunks in plan)
    say = report or (lambda message: None)
    base = {"model": name, "pid": os.getpid(), "chunks": total}
    t0 = time.monotonic()
    say({**base, "event": "start", "done": 0})
    computed, done = [], 0
    try:
        for section, chunks in plan:
            if not chunks:
                continue
            say({**base, "event": "section", "section": section_label(section), "done": done,
                 "section_chunks": len(chunks)})
            for key, compute in chunks:
                before = store.computed
                store.cached(key, compute)
                if store.computed > before:
                    computed.append(key)
                done += 1
                say({**base, "event": "chunk", "done": done})
        say({**base, "event": "done", "done": done, "computed": len(computed), "seconds": time.monotonic() - t0})
    finally:
        if hasattr(report, "close"):
            report.close()
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


class WorkerProgress:
    """What the workers report, shown on ``stream`` (default stderr): on a terminal a tqdm bar
    per worker ("worker 2 smollm2 · 7. Steering ...", chunks done of the model's); elsewhere
    one line per stage (a worker starting a model's section, and finishing the model).
    Workers are numbered 1, 2, ... in the order they first report. On a terminal the bars are
    redrawn every ``refresh`` seconds, so that their elapsed time runs while a long chunk
    computes. Called from the :class:`~powerlens._src.runtime.workers.Channel`'s threads."""

    def __init__(self, stream=None, tty: Optional[bool] = None, refresh: float = 1.0):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(tty if tty is not None else getattr(self.stream, "isatty", lambda: False)())
        self.numbers: Dict[int, int] = {}           # worker pid -> 1, 2, ...
        self.bars: Dict[str, object] = {}           # model -> its tqdm bar (terminal)
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.refresh = refresh
        self.ticker: Optional[threading.Thread] = None

    def _tick(self) -> None:
        while not self.closed.wait(self.refresh):
            with self.lock:
                for bar in self.bars.values():
                    bar.refresh()

    def line(self, text: str) -> None:
        if self.tty:
            from tqdm.auto import tqdm
            tqdm.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def __call__(self, message: dict) -> None:
        with self.lock:
            number = self.numbers.setdefault(message["pid"], len(self.numbers) + 1)
            who = f"worker {number} {message['model']}"
            event = message["event"]
            bar = self.bars.get(message["model"])
            if self.tty:
                if bar is None and event != "done":
                    from tqdm.auto import tqdm
                    bar = self.bars[message["model"]] = tqdm(total=message["chunks"], desc=who, unit=" chunks",
                                                             file=self.stream, leave=False, dynamic_ncols=True,
                                                             mininterval=0)
                    if self.ticker is None:
                        self.ticker = threading.Thread(target=self._tick, daemon=True)
                        self.ticker.start()
                if event == "section":
                    bar.set_description_str(f"{who} · {message['section']}")
                elif event == "chunk":
                    bar.update(message["done"] - bar.n)
                elif event == "done":
                    if bar is not None:
                        bar.close()
                        del self.bars[message["model"]]
                    self.line(self._finished(who, message))
            elif event == "section":
                self.line(f"powerlens reproduce: {who}: {message['section']} "
                          f"({message['done']} of {message['chunks']} chunks done)")
            elif event == "done":
                self.line(self._finished(who, message))

    @staticmethod
    def _finished(who: str, message: dict) -> str:
        return (f"powerlens reproduce: {who}: done, {message['computed']} of {message['chunks']} chunks computed "
                f"in {message['seconds']:.0f} s")

    def close(self) -> None:
        self.closed.set()
        with self.lock:
            for bar in self.bars.values():
                bar.close()
            self.bars.clear()


@contextlib.contextmanager
def model_workers(ctx, sections: Sequence[Callable], settings: dict, jobs, *, base_env: Optional[dict] = None):
    """Start up to ``jobs`` worker processes on the real models of ``sections`` (none when
    ``jobs`` is 1 or no section has model chunks) and register them in ``ctx.pending``;
    then start this process's XLA (:func:`~powerlens._src.runtime.threads.start_xla`: on one
    thread when asked, once the workers have forked). ``base_env``: the environment the
    workers start from (default ``os.environ``; the command line gives the user's, from before
    this process asked for one XLA thread).

    On leaving normally the pool is shut down (a worker still running is waited for). On
    Ctrl-C, SIGTERM or SIGHUP (turned into :class:`~powerlens._src.runtime.workers.Interrupted`
    meanwhile), or any other exception, every worker is stopped at once and the exception
    goes on; the chunks they finished are kept."""
    from ..runtime.workers import Channel, interrupt_on_signals, process_pool, stop_pool
    jobs = check_jobs(jobs)
    with_chunks = [s for s in sections if hasattr(s, "model_chunks")]
    names: List[str] = []
    if jobs != 1 and with_chunks:
        from .real_models import available_models
        found, _ = available_models(ctx)
        names = [n for n in found if chunks_of(ctx, with_chunks, n)]
    if not names or jobs == 1:
        start_xla()
        yield {}
        return
    names.sort(key=model_bytes, reverse=True)
    n = min(len(names), 2 * available_cores() if jobs is None else jobs)
    display = WorkerProgress() if ctx.show_progress else None
    with contextlib.ExitStack() as stack, interrupt_on_signals():
        channel = stack.enter_context(Channel(display)) if display is not None else None
        if display is not None:
            stack.callback(display.close)
        report = channel.reporter() if channel is not None else None
        pool = process_pool(n, start_method=start_method(), initializer=worker_main,
                            initargs=(worker_env(n, base=base_env),))
        try:
            pending = {m: pool.submit(compute_model, ctx.out, settings, ctx.quick, ctx.seed, list(ctx.models),
                                      [s.__name__ for s in with_chunks], m, report) for m in names}
            ctx.pending.update(pending)
            start_xla()           # this process's XLA, on the one thread asked for, now that the workers have forked
            yield pending
        except BaseException:
            ctx.pending.clear()
            stop_pool(pool)
            raise
        ctx.pending.clear()
        try:
            pool.shutdown(wait=True, cancel_futures=True)
        except BaseException:                        # interrupted while waiting for a worker
            stop_pool(pool)
            raise
