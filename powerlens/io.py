"""Atomic result writing: nothing is ever left half-written.

Every file is written to a temporary name in the same folder and moved into place
with ``os.replace``. ``output_dir`` stages a whole run in a sibling folder and only
moves the files into the target once the run has succeeded.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from typing import Any, Iterator

import numpy as np


def to_jsonable(obj: Any) -> Any:
    """NumPy/JAX scalars and arrays to Python; NaN and inf to ``None`` (valid JSON)."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if hasattr(obj, "__array__") and not isinstance(obj, (str, bytes)):
        arr = np.asarray(obj)
        if arr.ndim == 0:
            return to_jsonable(arr.item())
        return to_jsonable(arr.tolist())
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        f = float(obj)
        return f if math.isfinite(f) else None
    if isinstance(obj, complex):
        return [to_jsonable(obj.real), to_jsonable(obj.imag)]
    return obj


def _atomic(path: str, write) -> str:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)     # mkstemp makes 0600 files; results are for everyone to read
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def write_text(path: str, text: str) -> str:
    return _atomic(path, lambda fh: fh.write(text.encode("utf-8")))


def write_bytes(path: str, data: bytes) -> str:
    return _atomic(path, lambda fh: fh.write(data))


def write_json(path: str, obj: Any) -> str:
    return write_text(path, json.dumps(to_jsonable(obj), indent=2, sort_keys=False, allow_nan=False) + "\n")


def save_npy(path: str, arr) -> str:
    return _atomic(path, lambda fh: np.save(fh, np.asarray(arr)))


@contextlib.contextmanager
def output_dir(path: str) -> Iterator[str]:
    """Stage a run's files in a temporary sibling folder; publish them only on success.

    Yields the staging folder. On success each file is moved into ``path`` with
    ``os.replace`` (sub-folders too); on any exception the staging folder is removed
    and ``path`` is left as it was.
    """
    target = os.path.abspath(path)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    if os.path.exists(target) and not os.path.isdir(target):
        raise ValueError(f"--out {path!r} exists and is not a directory")
    stage = tempfile.mkdtemp(prefix="." + os.path.basename(target) + ".partial-", dir=parent)
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    try:
        if not os.path.exists(target):
            os.replace(stage, target)
            return
        for root, _, files in os.walk(stage):
            rel = os.path.relpath(root, stage)
            dest = os.path.normpath(os.path.join(target, rel))
            os.makedirs(dest, exist_ok=True)
            for f in files:
                os.replace(os.path.join(root, f), os.path.join(dest, f))
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def versions() -> dict:
    """Versions of the packages behind a result."""
    import importlib.metadata as md
    import platform
    out = {"python": platform.python_version()}
    for pkg in ("powerlens", "jax", "jaxlib", "flax", "optax", "numpy", "scipy", "transformers", "safetensors", "gguf"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    try:
        import jax
        out["jax_backend"] = jax.default_backend()
    except Exception:  # pragma: no cover
        pass
    return out
