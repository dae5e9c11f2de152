"""Progress of a steering run on stderr: the stage (method, frontier levels), the Adam step,
p(target) and the control KL so far at each level, elapsed time and ETA.

The optimisation runs from the host in chunks of compiled, vmapped Adam steps
(:func:`~.optimize.solve_in_chunks`, with or without progress, so the numbers are the same);
between chunks it reports the step reached and each target's values to the one active
:class:`SteerProgress` (:func:`active_progress`: the steering functions take
``progress=True``, not the object). A background thread refreshes the display at least every
``interval`` seconds, compiling included.

On a terminal: a tqdm bar per stage, and a line when it ends. Elsewhere (a file, a pipe): one
line when a stage starts, one every ``interval`` seconds while it runs, and one when it ends.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Optional, Sequence

import numpy as np

_ACTIVE: Optional["SteerProgress"] = None
_LOCK = threading.Lock()


def active_progress() -> Optional["SteerProgress"]:
    """The :class:`SteerProgress` now open (an enabled one inside its ``with``), or None."""
    return _ACTIVE


def _clock(seconds: float) -> str:
    s = int(max(seconds, 0))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class SteerProgress:
    """Stages of a steering run (module docstring). ``enabled`` False: silent, no thread."""

    def __init__(self, enabled: bool = True, *, stream=None, interval: float = 4.0, prefix: str = "steer"):
        self.enabled = bool(enabled)
        self.stream = sys.stderr if stream is None else stream
        self.interval = float(interval)
        self.prefix = prefix
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self._stage = None
        self._bar = None
        self._thread = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.lines = 0

    # -------------------------------------------------------------- context
    def __enter__(self):
        global _ACTIVE
        if self.enabled:
            with _LOCK:
                _ACTIVE = self
            self._thread = threading.Thread(target=self._beat, name="powerlens-steer-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        global _ACTIVE
        self.end_stage(ok=exc[0] is None)
        if self.enabled:
            self._stop.set()
            if self._thread is not None:
                self._thread.join(timeout=2.0)
            with _LOCK:
                if _ACTIVE is self:
                    _ACTIVE = None
        return False

    # -------------------------------------------------------------- stages
    def stage(self, name: str, *, total: Optional[int] = None, levels: Sequence[float] = (), announce: bool = True,
              value: str = "p min") -> None:
        """Start a stage (ending the previous one): ``total`` Adam steps for an optimisation, its
        frontier ``levels`` (one target each, run at once). ``announce`` False: on a stream that
        is not a terminal, no start and end lines unless the stage outlasts ``interval``.
        ``value``: the name of the per-level value the loop reports."""
        if not self.enabled:
            return
        self.end_stage()
        with self._lock:
            self._stage = {"name": name, "total": total, "levels": [float(v) for v in levels], "step": 0,
                           "p": {}, "kl": {}, "t0": time.monotonic(), "t_first": None, "i_first": 0,
                           "last_line": time.monotonic(), "announce": announce, "value": value, "lines": 0}
            if self.tty:
                from tqdm.auto import tqdm
                self._bar = tqdm(total=total, desc=f"{self.prefix}: {name}", file=self.stream, leave=False,
                                 unit=" steps", dynamic_ncols=True, mininterval=0.2,
                                 bar_format=None if total else "{desc} [{elapsed}]")
            elif announce:
                self._line(f"{name}" + (f": {total} Adam steps" if total else "")
                           + (f" at levels {'/'.join(f'{v:g}' for v in levels)}" if levels else ""))

    def step(self, i: int, p_min: float, kl: float, level: float) -> None:
        """Adam step ``i`` (0-based) of the target whose level is ``level`` reached ``p_min`` (the
        stage's value) and control KL ``kl`` (NaN: none)."""
        with self._lock:
            st = self._stage
            if st is None:
                return
            if st["t_first"] is None:
                st["t_first"], st["i_first"] = time.monotonic(), i
            key = min(st["levels"], key=lambda v: abs(v - level)) if st["levels"] else level
            st["p"][key], st["kl"][key] = p_min, kl
            if i + 1 > st["step"]:
                st["step"] = i + 1
                if self._bar is not None:
                    self._bar.n = min(st["step"], st["total"] or st["step"])
                    self._bar.set_postfix_str(self._values(st), refresh=False)
                    self._bar.refresh()

    def end_stage(self, ok: bool = True) -> None:
        with self._lock:
            st, self._stage = self._stage, None
            if st is None:
                return
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            if st["announce"] or st["lines"]:            # a terminal keeps this line when the bar goes
                self._line(f"{st['name']}: {'done' if ok else 'stopped'} in {_clock(time.monotonic() - st['t0'])}"
                           + (f"; {self._values(st)}" if st["p"] else ""))

    def note(self, text: str) -> None:
        """A one-off line (non-terminal streams; on a terminal it is written above the bar)."""
        if not self.enabled:
            return
        with self._lock:
            if self._bar is not None:
                self._bar.write(f"{self.prefix}: {text}", file=self.stream)
                self.lines += 1
            else:
                self._line(text)

    # -------------------------------------------------------------- display
    @staticmethod
    def _values(st) -> str:
        if not st["p"]:
            return ""
        lv = sorted(st["p"])
        text = f"{st['value']} " + "/".join(f"{st['p'][v]:.3g}" for v in lv)
        if all(np.isfinite(st["kl"][v]) for v in lv):
            text += ", KL " + "/".join(f"{max(st['kl'][v], 0.0):.3g}" for v in lv)
        return text

    def _status(self, st) -> str:
        now = time.monotonic()
        total = st["total"]
        text = st["name"]
        if total:
            text += f", Adam step {st['step']}/{total}"
            if st["t_first"] is not None and st["step"] > st["i_first"] + 1:
                rate = (st["step"] - st["i_first"] - 1) / max(now - st["t_first"], 1e-9)
                eta = f", ETA {_clock((total - st['step']) / rate)}" if rate > 0 else ""
            else:
                eta = ", compiling and finding the closed-form start" if st["t_first"] is None else ""
        else:
            eta = ""
        vals = self._values(st)
        return f"{text}{', ' + vals if vals else ''}, {_clock(now - st['t0'])} elapsed{eta}"

    def _line(self, text: str) -> None:
        print(f"{self.prefix}: {text}", file=self.stream, flush=True)
        self.lines += 1
        if self._stage is not None:
            self._stage["last_line"] = time.monotonic()

    def _beat(self) -> None:
        tick = min(0.5, self.interval / 4)
        while not self._stop.wait(tick):
            with self._lock:
                st = self._stage
                if st is None:
                    continue
                if self._bar is not None:
                    self._bar.set_postfix_str(self._values(st), refresh=False)
                    self._bar.refresh()          # keeps elapsed moving while compiling
                elif time.monotonic() - st["last_line"] >= self.interval:
                    st["lines"] += 1
                    self._line(self._status(st))


def format_levels(levels) -> str:
    """'0.1/0.3/0.5/0.9' for a plan line."""
    return "/".join(f"{float(v):g}" for v in np.atleast_1d(levels))
