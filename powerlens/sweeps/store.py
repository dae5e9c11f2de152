"""The one chunk store of ``sweep`` and ``reproduce``, and the rules of a sweep's output folder.

A store has three methods:

* ``cached(name, compute)``: the stored value of chunk ``name``, or ``compute()`` stored and
  returned. Values go through JSON both ways (:func:`jsonable`), so a resumed run gives
  exactly the numbers of an uninterrupted one;
* ``replace(name, value)``: store a recomputed chunk in place of one that did not match its
  sweep (the engine checks every stored chunk's provenance:
  :meth:`powerlens.sweeps.engine.Engine.mismatch`), so a stale chunk is recomputed once;
* ``adopt(names)``: count chunks ``names``, written by another process of the same run (a
  ``reproduce --jobs`` worker), as computed rather than resumed when they are read.

``loaded`` and ``computed`` count the chunks resumed (read back and kept) and computed (or adopted). Two kinds:

* :class:`MemoryStore`: a dict (``pl.sweep(spec)`` without ``out``);
* :class:`ChunkFolder`: one JSON file per chunk, written atomically (:func:`powerlens.io.write_json`),
  under ``OUT/.chunks/`` (a ``powerlens sweep`` folder: every process of a multi-process
  sweep writes its own chunks there) or ``OUT/.chunks/KEY/`` with KEY a hash of the run's
  settings (``powerlens reproduce``). A damaged file is recomputed and rewritten.

Folder rules (:func:`check_folder`): an absent or empty folder starts a sweep; a folder
this spec wrote resumes; a sweep with a different spec, or another command's folder, is
refused naming the difference, unless ``overwrite`` (then what powerlens wrote there is
removed and the sweep starts afresh). A folder holding anything powerlens did not write is
always refused.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any, Callable, Dict, Iterable, Optional

from .. import io
from .spec import differing_keys

CHUNKS = ".chunks"
COMMAND = "sweep"
FILES = ("results.parquet", "results.csv", "sweep.json", "report.html")   # what a finished sweep writes ...
FOLDERS = {CHUNKS: "*.json", "figures": "*.png"}                         # ... beside its chunks and figures

_ABSENT = object()


def jsonable(value: Any) -> Any:
    """The value as it reads back from JSON (NaN -> None, arrays -> lists)."""
    return json.loads(json.dumps(io.to_jsonable(value), allow_nan=False))


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


class ChunkFolder(MemoryStore):
    """Chunks as JSON files under ``OUT/.chunks/`` or, with ``settings``, ``OUT/.chunks/KEY/``
    (KEY = :func:`settings_key`): atomic writes; a damaged file reads as absent (recomputed).
    Chunk names map to file names with every character but letters, digits, ``-_.`` as ``_``."""

    def __init__(self, out: str, settings: Optional[dict] = None):
        super().__init__()
        self.root = os.path.join(out, CHUNKS) if settings is None else os.path.join(out, CHUNKS, settings_key(settings))
        os.makedirs(self.root, exist_ok=True)

    def path(self, name: str) -> str:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        return os.path.join(self.root, safe + ".json")

    def _read(self, name: str) -> Any:
        path = self.path(name)
        if not os.path.isfile(path):
            return _ABSENT
        try:
            with open(path, encoding="utf-8") as fh:
                return json.load(fh)
        except (ValueError, RecursionError):        # damaged (writes are atomic, so rare): recomputed
            return _ABSENT

    def _write(self, name: str, value: Any) -> None:
        io.write_json(self.path(name), value)

    def clear(self) -> None:
        """Remove this store's chunks (its folder, and ``.chunks/`` if that leaves it empty)."""
        shutil.rmtree(self.root, ignore_errors=True)
        parent = os.path.dirname(self.root)
        if os.path.basename(parent) == CHUNKS and os.path.isdir(parent) and not os.listdir(parent):
            os.rmdir(parent)


def check_folder(target: str, spec: dict, overwrite: bool) -> str:
    """What to do with ``--out``: ``"start"``, ``"resume"`` or ``"replace"``; a ValueError naming
    the folder (and the keys that differ) when refused. The rule is :func:`powerlens.io.decide_folder`'s."""
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
