"""Figures drawn by a forked process that imported the plotting modules while the command computed.

A short command (a warm one-prompt ``align``) spends about 0.35 s of CPU importing matplotlib
and the modules that draw, and about 0.3 s drawing, on one thread, after its numbers are known.
:class:`FigureProcess` forks at the start of the command, before JAX is imported (a process
whose JAX runtime has started must not fork): the child imports the drawing modules on the
other core while the parent computes, then draws what the parent sends it and exits. The
parent writes its JSON meanwhile and waits for the child before it publishes its folder.

Where forking is not possible or not safe (no ``os.fork``; JAX already imported, e.g. a library
caller or a test in-process; other threads running) every figure is drawn in this process, as
before: the files are the same either way. A failure in the child is raised in the parent as a
:class:`RuntimeError` with the child's message. The child ignores Ctrl-C (the parent stops it),
and ends when the parent ends (``PR_SET_PDEATHSIG`` on Linux).
"""
from __future__ import annotations

import importlib
import os
import pickle
import signal
import sys
import threading
from typing import Callable, Optional, Sequence


class FigureProcess:
    """``FigureProcess(modules)``: fork a child that imports ``modules`` now (None: no child,
    every call runs here); :meth:`draw`
    sends it one call ``fn(*args, **kwargs)`` (picklable, ``fn`` a module-level function or a
    bound method of a picklable value); :meth:`wait` waits for it and raises its error.
    A context manager: leaving it early (an exception) stops the child."""

    def __init__(self, modules: Optional[Sequence[str]]):
        self.pid: Optional[int] = None
        self._sent = False
        if modules is None or not hasattr(os, "fork") or "jax" in sys.modules or threading.active_count() > 1:
            return
        job_r, job_w = os.pipe()
        out_r, out_w = os.pipe()
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:                                          # the child: never returns
            os.close(job_w)
            os.close(out_r)
            _child(parent, modules, job_r, out_w)
        os.close(job_r)
        os.close(out_w)
        self.pid, self._job, self._out = pid, os.fdopen(job_w, "wb"), os.fdopen(out_r, "rb")

    def draw(self, fn: Callable, *args, **kwargs) -> None:
        """``fn(*args, **kwargs)`` in the child, or here when there is none."""
        if self.pid is None:
            fn(*args, **kwargs)
            return
        try:
            pickle.dump((fn, args, kwargs), self._job, protocol=pickle.HIGHEST_PROTOCOL)
            self._job.close()
        except (OSError, pickle.PicklingError, AttributeError, TypeError):
            self.close()                                      # the child is gone or the call does not pickle
            fn(*args, **kwargs)
            return
        self._sent = True

    def wait(self) -> None:
        """Wait for the child's drawing; its error, if any, as a RuntimeError here."""
        if self.pid is None:
            return
        try:
            message = self._out.read().decode("utf-8", "replace") if self._sent else ""
        finally:
            self.close()
        if self._sent and message != "ok":
            raise RuntimeError(f"drawing the figures failed: {message or 'the drawing process ended'}")

    def close(self) -> None:
        """Stop the child (if it still runs) and reap it."""
        if self.pid is None:
            return
        pid, self.pid = self.pid, None
        for fh in (self._job, self._out):
            try:
                fh.close()
            except OSError:
                pass
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done == 0:
                if not self._sent:
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        except (ChildProcessError, ProcessLookupError):
            pass

    def __enter__(self) -> "FigureProcess":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is not None:
            self._sent = False                                # what it drew is not wanted: stop it
        self.close()


def _child(parent: int, modules: Sequence[str], job_r: int, out_w: int) -> None:
    """Import ``modules``, run the one call read from ``job_r``, write "ok" or the error to
    ``out_w``, and end (``os._exit``: none of the parent's exit handlers run here)."""
    status = 1
    try:
        from .workers import bind_to_parent
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        bind_to_parent(parent)
        for name in modules:
            importlib.import_module(name)
        with os.fdopen(job_r, "rb") as fh:
            data = fh.read()
        if data:
            fn, args, kwargs = pickle.loads(data)
            try:
                fn(*args, **kwargs)
                message = "ok"
            except BaseException as exc:                      # noqa: BLE001  (reported to the parent)
                message = f"{type(exc).__name__}: {exc}"
            with os.fdopen(out_w, "wb") as fh:
                fh.write(message.encode("utf-8"))
        status = 0
    finally:
        os._exit(status)
