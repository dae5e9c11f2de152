"""Atomic result writing: nothing is ever left half-written.

Every file is written to a unique temporary name in the same folder and moved into place
with ``os.replace``. ``output_dir`` stages a whole run in a hidden sibling folder, under a
lock, and replaces the target folder with it only once the run has succeeded.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from typing import Any, Iterator, Optional

import numpy as np


def cache_dir() -> str:
    """powerlens's cache folder: ``$POWERLENS_CACHE``, else ``$XDG_CACHE_HOME/powerlens``, else
    ``~/.cache/powerlens`` (built tokenizers; the CLI's compiled XLA programs)."""
    if os.environ.get("POWERLENS_CACHE"):
        return os.environ["POWERLENS_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "powerlens")


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
        public_mode(tmp, 0o666)          # mkstemp makes 0600 files; results are for everyone to read
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
    """Write ``obj`` as JSON (NaN/inf -> null), indented for reading unless it is large: the
    indenting encoder is pure Python, ~10x slower than the compact one on a long run's rows."""
    doc = to_jsonable(obj)
    text = json.dumps(doc, allow_nan=False)
    if len(text) < 2_000_000:
        text = json.dumps(doc, indent=2, allow_nan=False)
    return write_text(path, text + "\n")


def save_npy(path: str, arr) -> str:
    return _atomic(path, lambda fh: np.save(fh, np.asarray(arr)))


MARKER = ".powerlens-output"          # in every folder powerlens wrote: JSON {"command", "settings"}


def check_out_path(path) -> str:
    """The absolute target of ``--out``; an empty path or an existing file is an error."""
    if path is None or not str(path).strip():
        raise ValueError("--out is empty: name the output folder")
    target = os.path.abspath(os.fspath(path))
    if os.path.exists(target) and not os.path.isdir(target):
        raise ValueError(f"--out {path!r} exists and is not a directory")
    return target


def read_marker(folder: str):
    """The marker of a folder powerlens wrote, or None (absent or unreadable)."""
    try:
        with open(os.path.join(folder, MARKER), encoding="utf-8") as fh:
            doc = json.load(fh)
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


def folder_state(folder: str) -> str:
    """``absent``, ``empty``, ``ours`` (has the marker) or ``foreign`` (anything else)."""
    if not os.path.isdir(folder):
        return "absent"
    try:
        entries = os.listdir(folder)
    except OSError as exc:
        raise ValueError(f"--out {folder}: cannot read the folder ({exc.strerror})") from None
    if not entries:
        return "empty"
    return "ours" if read_marker(folder) is not None else "foreign"


def refuse_foreign(path, state: str, overwrite: bool) -> None:
    if state == "foreign" and not overwrite:
        raise ValueError(f"--out {path}: the folder is not empty and was not written by powerlens; "
                         f"choose another folder or pass --overwrite to replace it")


def write_marker(folder: str, command: str, settings: Optional[dict] = None) -> str:
    return write_json(os.path.join(folder, MARKER), {"command": command, "settings": settings or {}})


def public_mode(path: str, mode: int = 0o777) -> None:
    """chmod to ``mode`` less the umask (mkdtemp/mkstemp make private 0700/0600 entries)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, mode & ~mask)


@contextlib.contextmanager
def folder_lock(target: str) -> Iterator[None]:
    """Hold an exclusive lock for writing ``target`` (the file ``.NAME.lock`` beside it).

    A second writer of the same folder is refused at once with a message naming the folder
    and the process that holds it. The lock file itself stays (empty, hidden).
    """
    import fcntl
    parent, name = os.path.split(target)
    try:
        os.makedirs(parent, exist_ok=True)
        fd = os.open(os.path.join(parent, f".{name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ValueError(f"--out {target}: cannot write there ({exc.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise ValueError(f"--out {target} is being written by another powerlens run (pid {holder}); "
                             f"wait for it to finish or choose another folder") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)                        # releases the lock


def remove_stale_staging(target: str) -> None:
    """Delete the hidden staging/old folders that a killed run left beside ``target``
    (call with the folder lock held: no live run owns them then)."""
    parent, name = os.path.split(target)
    for entry in os.listdir(parent):
        if entry.startswith((f".{name}.partial-", f".{name}.old-")):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


@contextlib.contextmanager
def output_dir(path: str, *, overwrite: bool = False, command: str = "powerlens",
               settings: Optional[dict] = None) -> Iterator[str]:
    """Stage a run's files in a hidden sibling folder; on success it replaces ``path`` whole.

    Rules (every command but ``reproduce``, which resumes into its folder):

    * an absent or empty folder, or one that powerlens wrote (it has the marker file
      ``.powerlens-output``), is replaced as a whole: old files never sit beside new ones;
    * a non-empty folder that powerlens did not write is refused unless ``overwrite``;
    * an empty ``path`` is an error; so is an existing file.

    The folder is locked for the whole run (a concurrent writer is refused), staging
    folders of killed runs are removed first, and on any exception ``path`` is left as it
    was. Folders get the usual permissions (0777 less the umask, 0755 typically).
    """
    target = check_out_path(path)
    parent, name = os.path.split(target)
    with folder_lock(target):
        remove_stale_staging(target)
        refuse_foreign(path, folder_state(target), overwrite)
        try:
            stage = tempfile.mkdtemp(prefix=f".{name}.partial-", dir=parent)
        except OSError as exc:
            raise ValueError(f"--out {path}: cannot write there ({exc.strerror})") from None
        try:
            public_mode(stage)
            yield stage
            write_marker(stage, command, settings)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        publish(stage, target)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False if unavailable."""
    import ctypes
    import sys
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    return fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0


def publish(stage: str, target: str) -> None:
    """Put the folder ``stage`` in place of ``target``: one atomic swap where the kernel
    offers it, else two renames (the old folder is kept aside until the new one is in)."""
    if not os.path.exists(target):
        os.replace(stage, target)
        return
    if _exchange(stage, target):
        shutil.rmtree(stage, ignore_errors=True)     # now holds the old folder
        return
    parent, name = os.path.split(target)
    old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
    os.replace(target, os.path.join(old, name))
    os.replace(stage, target)
    shutil.rmtree(old, ignore_errors=True)


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
