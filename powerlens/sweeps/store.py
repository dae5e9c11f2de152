"""Where finished chunks live, and the rules of a sweep's output folder.

A store has one method, ``cached(name, compute)``: the stored value of chunk ``name``, or
``compute()`` stored and returned (values go through JSON both ways, so a resumed sweep
gives exactly the numbers of an uninterrupted one). Three kinds:

* :class:`ChunkFolder`: ``OUT/.chunks/NAME.json`` of a ``powerlens sweep`` folder, written
  atomically; every process of a multi-process sweep writes its own chunks there;
* :class:`MemoryStore`: a dict (``pl.sweep(spec)`` without ``out``);
* ``reproduce``'s own :class:`~powerlens.reproduce.store.ChunkStore` (same protocol).

Folder rules (:func:`check_folder`): an absent or empty folder starts a sweep; a folder
this spec wrote resumes; a folder with a different spec is refused naming the keys that
differ, and one powerlens did not write (no marker) is refused, unless ``overwrite``
(then it is emptied and started afresh).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable, Dict

from .. import io
from .spec import differing_keys

CHUNKS = ".chunks"
COMMAND = "sweep"


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
            except ValueError:
                pass
        value = jsonable(compute())
        io.write_json(path, value)
        self.computed += 1
        return value


def check_folder(target: str, spec: dict, overwrite: bool) -> str:
    """What to do with ``--out``: ``"start"``, ``"resume"`` or ``"replace"`` (see module
    docstring); a ValueError naming the folder (and the keys that differ) when refused."""
    state = io.folder_state(target)
    if state in ("absent", "empty"):
        return "start"
    io.refuse_foreign(target, state, overwrite)
    if state == "foreign":
        return "replace"
    marker = io.read_marker(target) or {}
    if marker.get("command") != COMMAND:
        if overwrite:
            return "replace"
        raise ValueError(f"--out {target} holds the output of `powerlens {marker.get('command')}`, not a sweep; "
                         f"choose another folder or pass --overwrite to replace it")
    old = (marker.get("settings") or {}).get("spec") or {}
    keys = differing_keys(old, spec)
    if not keys:
        return "resume"
    if overwrite:
        return "replace"
    shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
    raise ValueError(f"--out {target} holds a sweep with a different spec (keys that differ: {shown}); "
                     f"pass --overwrite to start afresh, or choose another folder")


def prepare_folder(target: str, spec: dict, action: str) -> None:
    """Empty the folder for ``"replace"``, then mark it as this spec's sweep (process 0 only)."""
    if action == "replace":
        for entry in os.listdir(target):
            path = os.path.join(target, entry)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
    os.makedirs(target, exist_ok=True)
    io.write_marker(target, COMMAND, {"spec": spec})
