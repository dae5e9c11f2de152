"""Finished work on disk: every chunk of a sweep is written atomically as it finishes,
so an interrupted ``reproduce`` resumes from what is done.

Values go through JSON both when computed and when loaded, so a resumed run gives
exactly the same numbers as an uninterrupted one (Python floats round-trip exactly).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any, Callable

from .. import io


def settings_key(settings: dict) -> str:
    blob = json.dumps(io.to_jsonable(settings), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class ChunkStore:
    """A folder of finished chunks, keyed by the run's settings."""

    def __init__(self, out_dir: str, settings: dict):
        self.root = os.path.join(out_dir, ".chunks", settings_key(settings))
        os.makedirs(self.root, exist_ok=True)
        self.loaded = 0
        self.computed = 0
        self._fresh = set()        # chunks another process of this run computed (counted as computed)

    def adopt(self, names) -> None:
        """Count chunks ``names``, computed by a worker process of this run, as computed here."""
        self._fresh.update(names)

    def _path(self, name: str) -> str:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        return os.path.join(self.root, safe + ".json")

    def cached(self, name: str, compute: Callable[[], Any]) -> Any:
        """The stored value of chunk ``name``, computing and storing it if absent."""
        path = self._path(name)
        if os.path.isfile(path):
            try:
                with open(path) as fh:
                    value = json.load(fh)
                if name in self._fresh:
                    self.computed += 1
                else:
                    self.loaded += 1
                return value
            except ValueError:  # a damaged chunk is recomputed (writes are atomic, so rare)
                pass
        value = json.loads(json.dumps(io.to_jsonable(compute()), allow_nan=False))
        io.write_json(path, value)
        self.computed += 1
        return value

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        parent = os.path.dirname(self.root)
        if os.path.isdir(parent) and not os.listdir(parent):
            os.rmdir(parent)
