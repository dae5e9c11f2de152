"""The one chunk store of ``sweep`` and ``reproduce``, and the rules of a sweep's output folder.

A store has three methods:

* ``cached(name, compute)``: the stored value of chunk ``name``, or ``compute()`` stored and
  returned. Values go through JSON both ways (:func:`jsonable`), so a resumed run gives
  exactly the numbers of an uninterrupted one;
* ``replace(name, value)``: store a recomputed chunk in place of one that did not match its
  sweep (the engine checks every stored chunk's provenance:
  :func:`powerlens._src.sweeps.provenance.mismatch`), so a stale chunk is recomputed once;
* ``adopt(names)``: count chunks ``names``, written by another process of the same run (a
  ``reproduce --jobs`` worker), as computed rather than resumed when they are read.

:func:`stored` asks a store for a chunk without computing one. ``loaded`` and ``computed``
count the chunks resumed (read back and kept) and computed (or adopted). Two kinds:

* :class:`MemoryStore`: a dict (``pl.sweep(spec)`` without ``out``);
* :class:`ChunkFolder`: one JSON file per chunk, written atomically (:func:`powerlens._src.io.write_json`),
  under ``OUT/.chunks/`` (a ``powerlens sweep`` folder: every process of a multi-process
  sweep writes its own chunks there) or ``OUT/.chunks/KEY/`` with KEY a hash of the run's
  settings (``powerlens reproduce``). Each file is listed in the folder's ledger before it is
  written (:func:`powerlens._src.io.claim`), so ``--overwrite`` and ``clear`` remove exactly the
  chunks powerlens wrote. A damaged file is named in the log, recomputed and rewritten.

Folder rules (:func:`check_folder`): an absent or empty folder starts a sweep; a folder
this spec wrote resumes; a sweep with a different spec, or another command's folder, is
refused naming the difference, unless ``overwrite`` (then what powerlens wrote there is
removed and the sweep starts afresh). A folder holding anything powerlens did not write is
always refused.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from typing import Any, Callable, Dict, Iterable, Optional

from .. import io
from .schema import differing_keys

CHUNKS = ".chunks"
COMMAND = "sweep"
FILES = ("results.parquet", "results.csv", "sweep.json", "report.html")   # what a finished sweep writes ...
FOLDERS = (CHUNKS, "figures")         # ... beside its chunks and figures, each listed as written (io.claim)

_ABSENT = object()


def jsonable(value: Any) -> Any:
    """The value as it reads back from JSON (NaN -> None, arrays -> lists)."""
    return json.loads(json.dumps(io.to_jsonable(value), allow_nan=False))


class _Missing(Exception):
    """Raised by the compute function that only asks a store whether it has a chunk."""


def _missing():
    raise _Missing


def stored(store, name: str):
    """The chunk ``name`` from ``store``, or None (stores expose only ``cached``)."""
    try:
        return store.cached(name, _missing)
    except _Missing:
        return None


def settings_key(settings: dict) -> str:
    """16 hex digits of sha256 of ``settings`` (sorted JSON): the chunk subfolder of a run."""
    blob = json.dumps(io.to_jsonable(settings), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class MemoryStore:
    """Chunks in a dict (nothing written); the protocol of every store (module docstring)."""

    def __init__(self):
        self.values: Dict[str, Any] = {}
        self.computed = 0
        self._loaded: set = set()           # names read back and not replaced since
        self._adopted: set = set()

    @property
    def loaded(self) -> int:
        """Chunks read back (resumed) and kept: a stale one that was replaced counts as computed."""
        return len(self._loaded)

    def adopt(self, names: Iterable[str]) -> None:
        """Count chunks ``names``, computed by another process of this run, as computed here."""
        self._adopted.update(names)

    def cached(self, name: str, compute: Callable[[], Any]) -> Any:
        """The stored value of chunk ``name``, else ``compute()`` stored and returned."""
        value = self._read(name)
        if value is _ABSENT:
            return self.replace(name, compute())
        if name in self._adopted:
            self.computed += 1
        else:
            self._loaded.add(name)
        return value

    def replace(self, name: str, value: Any) -> Any:
        """Store ``value`` as chunk ``name``, in place of what was there; returns it as stored."""
        value = jsonable(value)
        self._write(name, value)
        self._loaded.discard(name)
        self.computed += 1
        return value

    def _read(self, name: str) -> Any:
        return self.values.get(name, _ABSENT)

    def _write(self, name: str, value: Any) -> None:
        self.values[name] = value


def _no_constant(name: str):
    raise ValueError(f"it holds {name}, which powerlens stores as null")


class ChunkFolder(MemoryStore):
    """Chunks as JSON files under ``OUT/.chunks/`` or, with ``settings``, ``OUT/.chunks/KEY/``
    (KEY = :func:`settings_key`): atomic writes, each file listed in the folder's ledger before
    it is written (:func:`powerlens._src.io.claim`). A damaged file (not JSON, or JSON that
    powerlens does not write, such as a NaN literal) is named in the log and recomputed.
    Chunk names map to file names with every character but letters, digits, ``-_.`` as ``_``."""

    def __init__(self, out: str, settings: Optional[dict] = None, *,
                 log: Optional[Callable[[str], None]] = None):
        super().__init__()
        self.out = out
        self.sub = CHUNKS if settings is None else f"{CHUNKS}/{settings_key(settings)}"
        self.root = io.claim(out, self.sub + "/")
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.damaged: Dict[str, str] = {}           # chunk name -> why its file was not read
        self._written: set = set()                  # files this store wrote (a folder with no marker has no ledger)
        os.makedirs(self.root, exist_ok=True)

    def path(self, name: str) -> str:
        return os.path.join(self.root, self._file(name))

    @staticmethod
    def _file(name: str) -> str:
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) + ".json"

    def _read(self, name: str) -> Any:
        path = self.path(name)
        if not os.path.isfile(path):
            return _ABSENT
        try:
            with open(path, encoding="utf-8") as fh:
                return json.load(fh, parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:   # damaged (writes are atomic, so rare): recomputed
            why = " ".join(str(exc).split())[:200] or type(exc).__name__
            if name not in self.damaged:            # said once, however often it is asked for
                self.damaged[name] = why
                self.log(f"powerlens: stored chunk {name} ({path}) is damaged ({why}); recomputing it")
            return _ABSENT

    def _write(self, name: str, value: Any) -> None:
        io.write_json(io.claim(self.out, f"{self.sub}/{self._file(name)}"), value)
        self._written.add(self._file(name))
        self.damaged.pop(name, None)

    def clear(self) -> None:
        """Remove this store's chunks: the files listed as written there (by any process of any
        run: :func:`powerlens._src.io.remove_owned`) and those it wrote itself, nothing else; then
        its folder and ``.chunks/`` where that leaves them empty."""
        for name in self._written:
            path = os.path.join(self.root, name)
            if os.path.isfile(path) and not os.path.islink(path):
                os.unlink(path)
        io.remove_owned(self.out, under=self.sub)
        for folder in (self.root, os.path.join(self.out, CHUNKS)):
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def check_folder(target: str, spec: dict, overwrite: bool) -> str:
    """What to do with ``--out``: ``"start"``, ``"resume"`` or ``"replace"``; a ValueError naming
    the folder (and the keys that differ) when refused. The rule is :func:`powerlens._src.io.decide_folder`'s."""
    return io.decide_folder(target, command=COMMAND, settings={"spec": spec}, overwrite=overwrite,
                            resume=_spec_difference)


def _spec_difference(old: dict, new: dict) -> str:
    keys = differing_keys(old.get("spec") or {}, new["spec"])
    if not keys:
        return ""
    shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
    return f"a sweep with a different spec (keys that differ: {shown})"


def prepare_folder(target: str, spec: dict, action: str) -> None:
    """For ``"replace"``, remove what powerlens wrote there; then mark the folder as this spec's
    sweep, listing the files it will hold (process 0 only)."""
    if action == "replace":
        io.remove_owned(target)
    io.mark_resumable(target, COMMAND, {"spec": spec}, files=FILES, folders=FOLDERS)
