"""Worker processes that end with their parent.

Every worker powerlens starts (``sweep --processes N``'s, :func:`spawn`; ``reproduce``'s
model workers, :func:`process_pool`):

* runs in its own process group (its pid), so that a terminal's Ctrl-C reaches the parent
  alone, and the parent stops a worker with anything it started (``killpg``, :func:`stop`);
* ignores SIGINT and takes SIGTERM's default action (it may have inherited a handler);
* on Linux asks the kernel for SIGKILL when its parent ends (``prctl(PR_SET_PDEATHSIG)``),
  and ends at once when its parent has gone already (:func:`bind_to_parent`): a parent killed
  with ``kill -9`` takes its workers with it.

The parent turns SIGTERM and SIGHUP into :class:`Interrupted`, a KeyboardInterrupt, while
its workers run (:func:`interrupt_on_signals`), so that unwinding stops them (SIGTERM, wait,
SIGKILL) and the command ends as after Ctrl-C: finished chunks are kept and the same command
resumes. A second signal takes its default action.

:class:`Channel` carries small messages (progress) from the workers to the parent, over a
private socket: the worker side (:class:`Reporter`) is a plain picklable value.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterable, List, Optional, Sequence

PARENT = "POWERLENS_PARENT_PID"
"""The environment variable that tells a worker started by :func:`spawn` its parent's pid
(the worker calls :func:`bind_to_parent_from_env`)."""

PR_SET_PDEATHSIG = 1                                   # <linux/prctl.h>

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
"""The signals that stop a command with workers as Ctrl-C does (SIGHUP: not on Windows)."""

KILL = getattr(signal, "SIGKILL", signal.SIGTERM)
"""What ends a process at once (SIGTERM does on Windows, which has no SIGKILL)."""

GRACE = 5.0
"""Seconds a worker gets between SIGTERM and SIGKILL when its parent stops it."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread while workers run; ``signum`` is the
    signal and ``status`` the exit status a shell gives a process it ended (128 + signum)."""

    def __init__(self, signum: int):
        super().__init__(f"{signal.Signals(signum).name}")
        self.signum = signum
        self.status = 128 + signum


def exit_status(exc: KeyboardInterrupt) -> int:
    """The exit status of a command ended by ``exc``: 128 + the signal (130 for Ctrl-C)."""
    return getattr(exc, "status", 128 + signal.SIGINT)


@contextlib.contextmanager
def interrupt_on_signals(signals: Iterable[int] = STOP_SIGNALS):
    """While inside: each of ``signals`` whose handler is the default raises
    :class:`Interrupted` in the main thread (once: the handler is then put back, so that a
    second signal takes the default action). Outside the main thread, or for a signal
    ignored or handled by someone else (``nohup``, a library caller), nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    installed = {}

    def handler(signum, frame):
        for s in installed:
            signal.signal(s, signal.SIG_DFL)
        raise Interrupted(signum)

    for s in signals:
        if signal.getsignal(s) is signal.SIG_DFL:
            installed[s] = signal.signal(s, handler)
    try:
        yield
    finally:
        for s, old in installed.items():
            signal.signal(s, old)


def _prctl_pdeathsig(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)`` through libc (Linux); whether it took."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):         # pragma: no cover - no libc prctl
        return False


def bind_to_parent(parent: int) -> None:
    """In a worker: end when process ``parent`` (the one that started it) ends. On Linux the
    kernel sends SIGKILL then (PR_SET_PDEATHSIG; finished chunks are written atomically, so
    nothing is half-written); anywhere, a parent that has gone already (the worker's parent
    pid is no longer ``parent``) ends this process now, with status 1."""
    if hasattr(signal, "SIGKILL"):
        _prctl_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def bind_to_parent_from_env(env: Optional[dict] = None) -> bool:
    """:func:`bind_to_parent` with the parent :data:`PARENT` names in ``env`` (default
    ``os.environ``), removed from it so that a worker's own children are not bound to it;
    False when it names none (not a worker)."""
    env = os.environ if env is None else env
    value = env.pop(PARENT, "")
    if not value.isdigit():
        return False
    bind_to_parent(int(value))
    return True


def _as_worker(parent: int) -> None:
    """What every worker does first: its own process group, Ctrl-C left to the parent,
    SIGTERM's default action, bound to ``parent``."""
    try:
        os.setpgid(0, 0)
    except (OSError, AttributeError):             # pragma: no cover - a session leader already; Windows
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    bind_to_parent(parent)


def _signal_group(pid: int, sig: int) -> None:
    """``sig`` to the process group of worker ``pid`` (its own), else to the worker alone."""
    try:
        os.killpg(pid, sig)
        return
    except (ProcessLookupError, PermissionError, AttributeError):     # AttributeError: Windows
        pass
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(pids: Sequence[int], alive: Callable[[int], bool], wait: Callable[[int, float], None],
         grace: float = GRACE) -> None:
    """Stop the workers ``pids`` (only those this process started): SIGTERM to each one's
    process group, up to ``grace`` seconds for them to end (``wait(pid, seconds)``), then
    SIGKILL to the groups of those still ``alive``."""
    running = [p for p in pids if alive(p)]
    for p in running:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in running:
        wait(p, max(0.0, deadline - time.monotonic()))
    for p in running:
        _signal_group(p, KILL)                    # the group: what the worker started too
    for p in running:
        wait(p, grace)


# ------------------------------------------------------------------ a pool of workers (reproduce)

def process_pool(n: int, *, start_method: str, initializer: Optional[Callable] = None, initargs: tuple = ()):
    """A ``concurrent.futures.ProcessPoolExecutor`` of ``n`` workers started with
    ``start_method`` (``fork`` or ``spawn``), each made a worker of this process
    (:func:`_as_worker`) before ``initializer(*initargs)`` runs. Stop it with
    :func:`stop_pool` when the parent is interrupted."""
    import concurrent.futures as futures
    import multiprocessing
    return futures.ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context(start_method),
                                       initializer=_start_pool_worker, initargs=(os.getpid(), initializer, initargs))


def _start_pool_worker(parent: int, initializer: Optional[Callable], initargs: tuple) -> None:
    _as_worker(parent)
    if initializer is not None:
        initializer(*initargs)


def stop_pool(pool, grace: float = GRACE) -> None:
    """Stop every worker of ``pool`` (:func:`process_pool`) now, running tasks included
    (:func:`stop`), then shut the pool down without waiting."""
    procs = dict(getattr(pool, "_processes", None) or {})     # pid -> multiprocessing.Process
    stop(list(procs), alive=lambda p: procs[p].is_alive(), wait=lambda p, t: procs[p].join(t), grace=grace)
    pool.shutdown(wait=False, cancel_futures=True)
    # let the pool's manager thread finish its clean-up now: at exit, concurrent.futures wakes
    # it through a pipe that this clean-up closes, and in Python 3.11 the two can race
    # ("OSError: Bad file descriptor" printed after the one-line message)
    manager = getattr(pool, "_executor_manager_thread", None)
    if manager is not None:
        manager.join(timeout=grace)


# ------------------------------------------------------------------ sweep --processes N

GLOO_PREFIX = "[Gloo] "
"""gloo's connection lines (written by its C++ code to stdout) start with this: the
launcher of local workers drops them."""


def spawn(argv: Sequence[str], n: int, *, quiet_others: bool = True) -> int:
    """``--processes N``: run ``powerlens sweep ARGV`` as N local workers; their exit status.

    Worker 0 serves the coordinator on a free 127.0.0.1 port; the workers' XLA and BLAS run
    single-threaded when they fill the cores (:func:`powerlens._src.runtime.threads.worker_env`).
    Their standard output passes through this process, less gloo's connection lines. When a
    worker fails the others are stopped and the first failure's status returned; on Ctrl-C,
    SIGTERM or SIGHUP every worker is stopped and 128 + the signal returned (finished chunks
    are kept: the same command resumes).
    """
    from .distributed import free_port
    from .threads import worker_env
    port = free_port()
    env = worker_env(n)
    env[PARENT] = str(os.getpid())
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
    procs: List[subprocess.Popen] = []
    readers: List[threading.Thread] = []
    lock = threading.Lock()
    failed = None
    try:
        with interrupt_on_signals():
            for i in range(n):
                cmd = [sys.executable, "-m", "powerlens.cli", "sweep", *argv, "--coordinator", f"127.0.0.1:{port}",
                       "--num-processes", str(n), "--process-id", str(i)]
                if quiet_others and i > 0:
                    cmd.append("--quiet")
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, **group))
                readers.append(threading.Thread(target=_forward, args=(procs[-1].stdout, lock), daemon=True))
                readers[-1].start()
            with lock:
                print(f"powerlens sweep: {n} workers on 127.0.0.1:{port}, "
                      f"pids {' '.join(str(p.pid) for p in procs)}", flush=True)
            while failed is None and any(p.poll() is None for p in procs):
                failed = _first_failure(procs)
                time.sleep(0.1)
            failed = _first_failure(procs)
    except BaseException:                           # Ctrl-C, Interrupted (SIGTERM, SIGHUP), a failed start
        _stop(procs)
        raise
    finally:
        if failed is not None:
            _stop(procs)
        for t in readers:
            t.join(timeout=5)
    if failed is not None:
        code = procs[failed].returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        print(f"powerlens sweep: worker {failed} {how}; the others were stopped. Finished chunks are kept: "
              f"run the same command again to resume", file=sys.stderr, flush=True)
        return code if code > 0 else 1
    return 0


def _first_failure(procs: List[subprocess.Popen]) -> Optional[int]:
    """The index of the worker whose failure to report, or None: a worker killed by a signal
    before one that exited with an error (a worker whose peer was killed fails in its next
    collective and exits at once; the kill is the cause), else the first that failed."""
    failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
    return next((i for i in failed if procs[i].returncode < 0), failed[0] if failed else None)


def _forward(stream, lock: threading.Lock) -> None:
    """Copy a worker's standard output to this process's, line by line, less gloo's lines."""
    out = sys.stdout
    for raw in iter(stream.readline, b""):
        if raw.startswith(GLOO_PREFIX.encode()):
            continue
        with lock:
            try:
                out.write(raw.decode("utf-8", "replace"))
                out.flush()
            except (OSError, ValueError):           # our stdout closed: keep draining the pipe
                pass
    stream.close()


def _stop(procs: List[subprocess.Popen]) -> None:
    """Stop the workers still running (the ones this launcher started)."""
    by_pid = {p.pid: p for p in procs}

    def wait(pid, seconds):
        try:
            by_pid[pid].wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            pass

    stop(list(by_pid), alive=lambda pid: by_pid[pid].poll() is None, wait=wait)


# ------------------------------------------------------------------ messages from workers

@dataclasses.dataclass
class Reporter:
    """The worker side of a :class:`Channel`: ``reporter(message)`` sends one picklable
    message to the parent (best effort: a parent that stopped listening loses it, and the
    worker goes on). A plain value, pickled into each task; it connects on first use."""
    address: Any
    authkey: bytes

    def __call__(self, message: Any) -> None:
        conn = self.__dict__.get("_conn")
        try:
            if conn is None:
                from multiprocessing.connection import Client
                conn = self.__dict__["_conn"] = Client(self.address, authkey=self.authkey)
            conn.send(message)
        except (OSError, EOFError, ValueError):
            self.__dict__["_conn"] = None

    def close(self) -> None:
        conn = self.__dict__.pop("_conn", None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()

    def __getstate__(self):
        return {"address": self.address, "authkey": self.authkey}


class Channel:
    """Messages from workers to this process: a listener on a private local socket (an
    AF_UNIX path, or a named pipe on Windows) with a random key; :meth:`reporter` is the
    value a worker sends with, ``receive(message)`` runs here, on a background thread, for
    each message. A context manager; closing it stops listening."""

    def __init__(self, receive: Callable[[Any], None]):
        from multiprocessing.connection import Listener
        self._receive = receive
        self._authkey = os.urandom(16)
        self._listener = Listener(authkey=self._authkey)
        self._closed = threading.Event()
        self._threads: List[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def reporter(self) -> Reporter:
        return Reporter(self._listener.address, self._authkey)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn = self._listener.accept()
            except Exception:                       # noqa: BLE001 (a stranger with another key, or closed)
                if self._closed.is_set():
                    return
                continue
            if self._closed.is_set():
                conn.close()
                return
            t = threading.Thread(target=self._read, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _read(self, conn) -> None:
        with conn:
            while True:
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    return
                except Exception:                   # noqa: BLE001 (a message that does not unpickle)
                    continue
                try:
                    self._receive(message)
                except Exception:                   # noqa: BLE001 (a display error must not stop the run)
                    pass

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(Exception):       # wake the accepting thread
            from multiprocessing.connection import Client
            Client(self._listener.address, authkey=self._authkey).close()
        self._accepting.join(timeout=2)
        for t in self._threads:
            t.join(timeout=2)
        with contextlib.suppress(OSError):
            self._listener.close()

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
