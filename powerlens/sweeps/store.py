"""Where finished chunks live, and the rules of a sweep's output folder.

A store has one method, ``cached(name, compute)``: the stored value of chunk ``name``, or
``compute()`` stored and returned (values go through JSON both ways, so a resumed sweep
gives exactly the numbers of an uninterrupted one); and may have ``replace(name, value)``,
which stores a recomputed chunk in place of one that did not match its sweep (the engine
checks every stored chunk's provenance: :meth:`powerlens.sweeps.engine.Engine.mismatch`).
Three kinds:

* :class:`ChunkFolder`: ``OUT/.chunks/NAME.json`` of a ``powerlens sweep`` folder, written
  atomically; every process of a multi-process sweep writes its own chunks there;
* :class:`MemoryStore`: a dict (``pl.sweep(spec)`` without ``out``);
* ``reproduce``'s own :class:`~powerlens.reproduce.store.ChunkStore` (same protocol).

Folder rules (:func:`check_folder`): an absent or empty folder starts a sweep; a folder
this spec wrote resumes; a sweep with a different spec, or another command's folder, is
refused naming the difference, unless ``overwrite`` (then what powerlens wrote there is
removed and the sweep starts afresh). A folder holding anything powerlens did not write is
always refused.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict

from .. import io
from .spec import differing_keys

CHUNKS = ".chunks"
COMMAND = "sweep"
FILES = ("results.parquet", "results.csv", "sweep.json", "report.html")   # what a finished sweep writes ...
FOLDERS = {CHUNKS: "*.json", "figures": "*.png"}                         # ... beside its chunks and figures


def jsonable(value: Any) -> Any:
    """The value as it reads back from JSON (NaN -> None, arrays -> lists)."""
    return json.loads(json.dumps(io.to_jsonable(value), allow_nan=False))


class MemoryStore:
    """Chunks in a dict (nothing written)."""

    def __init__(self):
        self.values: Dict[str, Any] = {}
        self.loaded = self.computed = 0

    def cached(self, name: str, compute: Callable[[], Any]) -> Any:
        if name in self.values:
            self.loaded += 1
            return self.values[name]
        value = self.values[name] = jsonable(compute())
        self.computed += 1
        return value

    def replace(self, name: str, value: Any) -> Any:
        """Store ``value`` as chunk ``name``, in place of what was there."""
        value = self.values[name] = jsonable(value)
        self.computed += 1
        return value


class ChunkFolder(MemoryStore):
    """Chunks as JSON files under ``OUT/.chunks/`` (atomic writes; a damaged one is recomputed)."""

    def __init__(self, out: str):
        super().__init__()
        self.root = os.path.join(out, CHUNKS)
        os.makedirs(self.root, exist_ok=True)

    def path(self, name: str) -> str:
        return os.path.join(self.root, name + ".json")

    def cached(self, name: str, compute: Callable[[], Any]) -> Any:
        path = self.path(name)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as fh:
                    value = json.load(fh)
                self.loaded += 1
                return value
            except (ValueError, RecursionError):        # damaged: recomputed
                pass
        return self.replace(name, compute())

    def replace(self, name: str, value: Any) -> Any:
        """Write ``value`` as chunk ``name`` (atomically), in place of what was there."""
        value = jsonable(value)
        io.write_json(self.path(name), value)
        self.computed += 1
        return value


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
