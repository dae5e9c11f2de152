"""Atomic result writing and output folders: nothing is ever left half-written, and
powerlens removes or replaces only what it wrote.

Every file is written to a unique temporary name in the same folder and moved into place
with ``os.replace``. Every command decides what to do with its ``--out`` folder through
:func:`decide_folder`; a folder powerlens wrote carries a marker listing its files.
``output_dir`` stages a whole run in a hidden sibling folder, under a lock, and replaces the
target folder with it only once the run has succeeded.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import math
import os
import posixpath
import re
import shutil
import socket
import stat
import tempfile
from typing import Any, Callable, Dict, FrozenSet, Iterable, Iterator, Optional

import numpy as np


def cache_dir() -> str:
    """powerlens's cache folder: ``$POWERLENS_CACHE``, else ``$XDG_CACHE_HOME/powerlens``, else
    ``~/.cache/powerlens`` (built tokenizers; the CLI's compiled XLA programs)."""
    if os.environ.get("POWERLENS_CACHE"):
        return os.environ["POWERLENS_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "powerlens")


def hf_cache_dir() -> str:
    """The Hugging Face hub cache folder (HF_HUB_CACHE, HF_HOME/hub or ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def hub_cache_path(repo_id: str, revision: str = "main") -> Optional[str]:
    """The snapshot folder of ``repo_id`` in the local HF cache, or None.

    Reads the cache layout directly (``models--org--name/refs/<revision>`` ->
    ``snapshots/<hash>``): no network, no hub client start-up (and no numerical library: the
    command line checks a model name with it before importing any).
    """
    if not repo_id or repo_id.startswith(("/", ".")) or repo_id.count("/") > 1:
        return None
    root = os.path.join(hf_cache_dir(), "models--" + repo_id.replace("/", "--"))
    snapshots = os.path.join(root, "snapshots")
    if not os.path.isdir(snapshots):
        return None
    ref = os.path.join(root, "refs", revision)
    if os.path.isfile(ref):
        with open(ref) as fh:
            path = os.path.join(snapshots, fh.read().strip())
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
    for name in sorted(os.listdir(snapshots)):   # no ref: any snapshot with a config
        path = os.path.join(snapshots, name)
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
    return None


def read_toml(path: str) -> dict:
    """The raw table of a TOML file (a sweep spec); a missing, malformed, non-UTF-8 or too
    deeply nested file is one ValueError naming the file (and the line, for malformed TOML)."""
    import tomllib
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the spec ({exc.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at line {line}); "
                         f"a spec is a UTF-8 TOML file") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: malformed TOML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise ValueError(f"{path}: nested too deeply to be a sweep spec") from None


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


def atomic_write(path: str, write) -> str:
    """Write ``path`` all or nothing: ``write(fh)`` fills a temporary file in the same folder,
    which then replaces ``path`` (``os.replace``). Returns ``path``."""
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
    return atomic_write(path, lambda fh: fh.write(text.encode("utf-8")))


def write_bytes(path: str, data: bytes) -> str:
    return atomic_write(path, lambda fh: fh.write(data))


def write_json(path: str, obj: Any) -> str:
    """Write ``obj`` as JSON (NaN/inf -> null), indented for reading unless it is large: the
    indenting encoder is pure Python, ~10x slower than the compact one on a long run's rows."""
    doc = to_jsonable(obj)
    text = json.dumps(doc, allow_nan=False)
    if len(text) < 2_000_000:
        text = json.dumps(doc, indent=2, allow_nan=False)
    return write_text(path, text + "\n")


def save_npy(path: str, arr) -> str:
    return atomic_write(path, lambda fh: np.save(fh, np.asarray(arr)))


# ------------------------------------------------------------------ output folders
#
# The rule of every command: powerlens removes or replaces only what it wrote. A folder it
# wrote carries the marker MARKER, which lists its files; decide_folder() is the one decision
# (start, resume, replace or refuse) that every command takes before it writes.

MARKER = ".powerlens-output"
"""The marker file, JSON ``{"command", "settings", "files", "folders"}``: ``files`` are the
paths (relative, '/'-separated) of the files powerlens wrote in the folder; ``folders`` the
subfolders it made there. Resumable runs (``sweep``, ``reproduce``), whose chunks and figures
appear one by one, list each further file before writing it in a ledger (:func:`claim`)."""

LEDGER = ".powerlens-written-"
"""Ledgers, ``LEDGER + HOST-PID`` beside the marker: the paths (one a line; a folder ends in
'/') that one process of a resumable run listed before writing them (:func:`claim`). Each
process appends to its own ledger only, so processes on several hosts never share a file."""

_BEING_WRITTEN = re.compile(r"\.(.+)\.[A-Za-z0-9_]+\.tmp(?:\.png)?")     # a file's temporary name while written


def _relative(path) -> bool:
    """True for a clean relative '/'-separated path that stays inside its folder."""
    return (isinstance(path, str) and bool(path) and not path.startswith("/") and "\n" not in path
            and all(part not in ("", ".", "..") for part in path.split("/")))


@dataclasses.dataclass(frozen=True)
class Contents:
    """What powerlens wrote in an output folder, as its marker and ledgers list it (nothing
    without a marker).

    ``files``: relative paths of its files (the marker and the ledgers included); ``folders``:
    the subfolders it made. A file being written (``.NAME.X.tmp``, see :func:`write_text`;
    ``.NAME.X.tmp.png`` for a figure) counts as ``NAME``. Nothing is owned by pattern: a file
    that no list names is the user's.
    """
    files: FrozenSet[str] = frozenset()
    folders: FrozenSet[str] = frozenset()

    @classmethod
    def of(cls, marker: Optional[dict], ledgers: Dict[str, list] = None) -> "Contents":
        """From a marker (a dict; an older marker's ``folders`` mapping counts by its keys) and
        the ledgers' lines (ledger name -> its paths)."""
        if not isinstance(marker, dict):
            return cls()
        files, folders = marker.get("files"), marker.get("folders")
        files = {p for p in files if _relative(p)} if isinstance(files, list) else set()
        folders = {f for f in folders if _relative(f)} if isinstance(folders, (list, dict)) else set()
        for name, lines in (ledgers or {}).items():
            files.add(name)
            for line in lines:
                if line.endswith("/") and _relative(line[:-1]):
                    folders.add(line[:-1])
                elif _relative(line):
                    files.add(line)
        return cls(frozenset(files) | {MARKER}, frozenset(folders))

    @classmethod
    def read(cls, folder: str) -> "Contents":
        """What the marker and the ledgers of ``folder`` list (nothing without a marker)."""
        marker = read_marker(folder)
        return cls.of(marker, _read_ledgers(folder) if marker is not None else {})

    @functools.cached_property
    def _dirs(self) -> FrozenSet[str]:
        """Every owned folder and every folder on the way to an owned file or folder."""
        out = set()
        for path in [*self.files, *self.folders]:
            parts = path.split("/")
            out.update("/".join(parts[:i]) for i in range(1, len(parts)))
        return frozenset(out | self.folders)

    def owns_file(self, rel: str) -> bool:
        if rel in self.files:
            return True
        head, base = posixpath.split(rel)
        written = _BEING_WRITTEN.fullmatch(base)
        return written is not None and posixpath.join(head, written.group(1)) in self.files

    def owns_dir(self, rel: str) -> bool:
        """A folder powerlens made, or one on the way to a listed path."""
        return rel in self._dirs


def _read_ledgers(folder: str) -> Dict[str, list]:
    """The complete lines of every ledger (a plain file, never followed through a link) in ``folder``."""
    out = {}
    for name in os.listdir(folder):
        if not name.startswith(LEDGER):
            continue
        try:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            with os.fdopen(os.dup(fd), "rb") as fh:
                text = fh.read().decode("utf-8", errors="replace")
        finally:
            os.close(fd)
        out[name] = text.split("\n")[:-1]         # a last line without its newline was being written
    return out


def claim(folder: str, rel: str) -> str:
    """List ``rel`` (a path relative to ``folder``; a folder ends in '/') as powerlens's, before
    it is written, in this process's ledger of the marked output folder ``folder``; returns
    its absolute path. In a folder without a marker, nothing is listed."""
    path = rel[:-1] if rel.endswith("/") else rel
    if not _relative(path):
        raise ValueError(f"not a relative path inside the output folder: {rel!r}")
    if os.path.isfile(os.path.join(folder, MARKER)):
        host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"
        ledger = os.path.join(folder, f"{LEDGER}{host}-{os.getpid()}")
        fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, (rel + "\n").encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
    return os.path.join(folder, *path.split("/"))


def read_marker(folder: str):
    """The marker of a folder powerlens wrote, or None (absent or unreadable)."""
    try:
        with open(os.path.join(folder, MARKER), encoding="utf-8") as fh:
            doc = json.load(fh)
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


def write_marker(folder: str, command: str, settings: Optional[dict] = None, *, files=(),
                 folders: Iterable[str] = ()) -> str:
    """Mark ``folder`` as written by ``command``, listing ``files`` (relative paths) and the
    subfolders ``folders`` it makes; see :data:`MARKER`."""
    return write_json(os.path.join(folder, MARKER), {"command": command, "settings": settings or {},
                                                     "files": sorted(files), "folders": sorted(folders)})


def foreign_entries(folder: str) -> Iterator[str]:
    """The entries of ``folder`` that powerlens did not write, as relative paths, sorted.

    That is every file its marker and ledgers do not list (everything, without a marker), every
    symlink (powerlens writes none, and none is followed), anything that is not a plain file,
    and every folder they do not reach: its files, or ``NAME/`` when it is empty.

    Another process of the same run may write the folder meanwhile (process 0 of a sweep while
    the others look at it). Each file is listed before it is written (:func:`claim`), so what
    looks foreign against the lists read before the scan is checked again against the lists
    read after it: a ledger, chunk or subfolder that appeared during the scan is not taken for
    the user's, and one that is gone again was not.
    """
    first = list(_foreign(folder, "", Contents.read(folder)))
    if not first:
        return iter(())
    again = Contents.read(folder)
    return iter([rel for rel in first if _still_foreign(folder, rel, again)])


def _still_foreign(folder: str, rel: str, contents: "Contents") -> bool:
    """Whether ``rel`` (a file, or a folder ``NAME/``) is still there and still not powerlens's."""
    path = os.path.join(folder, *rel.rstrip("/").split("/"))
    if not os.path.lexists(path):
        return False
    if os.path.islink(path):
        return True
    if rel.endswith("/"):
        return not contents.owns_dir(rel[:-1])
    return not (os.path.isfile(path) and contents.owns_file(rel))


def _foreign(folder: str, rel: str, contents: Contents) -> Iterator[str]:
    with os.scandir(os.path.join(folder, rel)) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        path = posixpath.join(rel, entry.name) if rel else entry.name
        if entry.is_dir(follow_symlinks=False):
            inner = contents if contents.owns_dir(path) else Contents()
            empty = True
            for inside in _foreign(folder, path, inner):
                empty = False
                yield inside
            if empty and inner is not contents:
                yield path + "/"
        elif not (entry.is_file(follow_symlinks=False) and contents.owns_file(path)):
            yield path


def remove_owned(folder: str, under: str = "") -> None:
    """Delete what powerlens wrote in ``folder`` (what its marker and ledgers list; the ledgers,
    then the marker, last) and the subfolders that leaves empty; nothing else, and nothing
    through a symlink. The folder stays. With ``under`` (a relative subfolder), only what is
    listed below it, and that subfolder if it is left empty; the marker and ledgers stay."""
    contents = Contents.read(folder)
    try:
        if under:
            if contents.owns_dir(under) and os.path.isdir(os.path.join(folder, under)) \
                    and not os.path.islink(os.path.join(folder, under)):
                _remove(folder, under, contents)
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(folder, under))
            return
        _remove(folder, "", contents)
        if contents.files:                           # a marker: its ledgers, then itself
            for name in [*sorted(f for f in contents.files if f.startswith(LEDGER)), MARKER]:
                path = os.path.join(folder, name)
                if os.path.isfile(path) and not os.path.islink(path):
                    os.unlink(path)
    except OSError as exc:
        raise ValueError(f"--out {folder}: cannot remove {exc.filename or 'its files'} ({exc.strerror})") from None


def _remove(folder: str, rel: str, contents: Contents) -> None:
    with os.scandir(os.path.join(folder, rel)) as it:
        entries = list(it)
    for entry in entries:
        path = posixpath.join(rel, entry.name) if rel else entry.name
        if entry.is_dir(follow_symlinks=False):
            if contents.owns_dir(path):
                _remove(folder, path, contents)
                with contextlib.suppress(OSError):      # not empty: something of the user's is inside
                    os.rmdir(entry.path)
        elif (path != MARKER and not (not rel and entry.name.startswith(LEDGER))
              and entry.is_file(follow_symlinks=False) and contents.owns_file(path)):
            os.unlink(entry.path)


def _discard(folder: str) -> None:
    """Remove a replaced output folder: what powerlens wrote, then the folder if that empties it."""
    remove_owned(folder)
    with contextlib.suppress(OSError):
        os.rmdir(folder)


def _contains(outer: str, inner: str) -> bool:
    """True if the absolute path ``inner`` is ``outer`` or below it."""
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def _protected(target: str) -> Optional[str]:
    """Why ``target`` can never be an output folder (None if it can): it is the current folder,
    the home folder, or one above either."""
    try:
        cwd = os.path.realpath(os.getcwd())
    except OSError:
        cwd = None
    home = os.path.realpath(os.path.expanduser("~"))
    if target == cwd:
        return "the current folder"
    if target == home:
        return "the home folder"
    if cwd and _contains(target, cwd):
        return "a folder above the current one"
    if _contains(target, home):
        return "a folder above the home folder"
    return None


def _new_folder(base: str, command: Optional[str]) -> str:
    """A folder that does not exist yet, for a refusal to suggest: ``base/COMMAND`` (or
    ``base/COMMAND-2``, ...), spelled from ``base`` as the user gave it."""
    name = command or "powerlens-out"
    real = os.path.realpath(os.path.expanduser(base))
    for i in range(1, 100):
        candidate = name if i == 1 else f"{name}-{i}"
        if not os.path.lexists(os.path.join(real, candidate)):
            return os.path.join(base, candidate)
    return os.path.join(base, name)


def check_out_path(path, *, command: Optional[str] = None) -> str:
    """The absolute target of ``--out`` (``~`` expanded, symlinks resolved).

    One-line errors, before anything is created: an empty path; an existing file; the current
    folder or one above it (``.``, ``..``, ``/``); the home folder (``~``) or one above it.
    """
    if path is None or not str(path).strip():
        raise ValueError("--out is empty: name the output folder")
    raw = os.fspath(path)
    target = os.path.realpath(os.path.expanduser(raw))
    if os.path.exists(target) and not os.path.isdir(target):
        raise ValueError(f"--out {path!r} exists and is not a directory")
    why = _protected(target)
    if why:
        base = raw if why in ("the current folder", "the home folder") else "."
        raise ValueError(f"--out {raw}: {target} is {why} and cannot be an output folder; "
                         f"choose a new folder, e.g. --out {_new_folder(base, command)}")
    return target


def decide_folder(path, *, command: str, settings: Optional[dict] = None, overwrite: bool = False,
                  resume: Optional[Callable[[dict, dict], str]] = None) -> str:
    """What ``command`` may do with its output folder ``path``: the one rule of every command.

    Returns ``"start"`` (absent or empty), ``"resume"`` or ``"replace"`` (only then may the
    caller remove anything, with :func:`remove_owned` or by swapping the folder), or raises a
    one-line ValueError, having changed nothing:

    * the paths :func:`check_out_path` refuses, with or without ``overwrite``;
    * a folder holding anything powerlens did not write (see :func:`foreign_entries`), with or
      without ``overwrite``: the message names one such entry and suggests a new folder;
    * a folder powerlens wrote: a command that replaces its output whole (``resume`` None)
      replaces it, whoever wrote it. A resumable command passes ``resume(old_settings,
      settings)``, a phrase saying how the settings differ ('' when they do not): the same
      command with the same settings resumes; another command or other settings are refused
      naming the difference, unless ``overwrite``, which replaces it.
    """
    target = check_out_path(path, command=command)
    if not os.path.isdir(target):
        return "start"
    try:
        foreign = next(foreign_entries(target), None)
    except OSError as exc:
        raise ValueError(f"--out {path}: cannot read the folder ({exc.strerror})") from None
    marker = read_marker(target)
    if foreign is not None:
        link = " (a symbolic link)" if os.path.islink(os.path.join(target, foreign.rstrip("/"))) else ""
        unlisted = (f" (its {MARKER} lists no files)" if marker is not None and "files" not in marker else
                    f" (its {MARKER}, from an older powerlens, does not list its chunks and figures)"
                    if marker is not None and isinstance(marker.get("folders"), dict) else "")
        raise ValueError(f"--out {path}: {foreign!r}{link} was not written by powerlens{unlisted}, and powerlens "
                         f"deletes only what it wrote; choose a new folder, e.g. --out "
                         f"{_new_folder(os.fspath(path), command)}")
    if marker is None:
        return "start"                               # an empty folder
    if resume is None:
        return "replace"
    if marker.get("command") != command:
        problem = f"the output of `powerlens {marker.get('command')}`, not of `powerlens {command}`"
    else:
        problem = resume(marker.get("settings") or {}, settings or {})
        if not problem:
            return "resume"
    if overwrite:
        return "replace"
    raise ValueError(f"--out {path} holds {problem}; pass --overwrite to replace it (only what powerlens "
                     f"wrote there is removed), or choose another folder")


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def write_error(target: str, exc: OSError) -> ValueError:
    """The one-line error for a failed write into the output folder ``target``."""
    if exc.errno in DISK_FULL:
        return ValueError(f"--out {target}: the disk is full ({exc.strerror}); free some space or "
                          f"choose a folder on another disk")
    return ValueError(f"--out {target}: cannot write there ({exc.strerror})")


def mark_resumable(folder: str, command: str, settings: dict, *, files, folders: Iterable[str]) -> None:
    """Create ``folder`` if need be and mark it as a resumable run's (``sweep``, ``reproduce``):
    the ``files`` it will hold and the subfolders ``folders`` it makes (see :data:`MARKER`);
    each further file (a chunk, a figure) is listed by :func:`claim` before it is written. On
    failure, a folder made here is removed again."""
    try:
        created = _make_folders(folder)
    except OSError as exc:
        raise write_error(folder, exc) from None
    try:
        write_marker(folder, command, settings, files=files, folders=folders)
    except OSError as exc:
        _remove_empty(created)
        raise write_error(folder, exc) from None


def public_mode(path: str, mode: int = 0o777) -> None:
    """chmod to ``mode`` less the umask (mkdtemp/mkstemp make private 0700/0600 entries)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, mode & ~mask)


def _make_folders(folder: str) -> list:
    """``os.makedirs(folder)``, returning the folders it created, outermost first."""
    missing = []
    while not os.path.isdir(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    created = []
    try:
        for path in reversed(missing):
            os.mkdir(path)
            created.append(path)
    except OSError:
        _remove_empty(created)
        raise
    return created


def _remove_empty(folders: list) -> None:
    """Remove ``folders`` (outermost first) again where they are still empty."""
    for path in reversed(folders):
        try:
            os.rmdir(path)
        except OSError:
            return


LOCK_TEXT = "powerlens lock, pid {pid}\n"
"""What a lock file holds: how powerlens recognises one that a killed run left."""


def _lock_pid(fd: int) -> Optional[str]:
    """The pid a powerlens lock file records (a bare pid: an older powerlens's), or None when
    the file is not one powerlens wrote."""
    text = os.pread(fd, 64, 0).decode("ascii", errors="replace")
    match = re.fullmatch(r"powerlens lock, pid (\d{1,10})\n|(\d{1,10})", text)
    return None if match is None else match.group(1) or match.group(2)


def _not_a_lock(path: str, target: str, what: str) -> ValueError:
    return ValueError(f"--out {target}: its lock path {path} is {what}; powerlens never follows, changes or "
                      f"removes it: move it away or choose another folder")


def _open_lock(path: str, target: str) -> Optional[int]:
    """Open the existing lock file ``path`` (None if it vanished meanwhile): a plain file only,
    never through a symbolic link."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise _not_a_lock(path, target, "a symbolic link")
    if not stat.S_ISREG(st.st_mode):
        raise _not_a_lock(path, target, "not a plain file")
    try:
        return os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _not_a_lock(path, target, "a symbolic link") from None
        raise ValueError(f"--out {target}: cannot open its lock file {path} ({exc.strerror})") from None


def _acquire(path: str, target: str) -> int:
    """Create and lock the lock file ``path`` (refused at once when held); returns its descriptor.

    The file is created afresh (``O_CREAT | O_EXCL | O_NOFOLLOW``: never through a link) and
    holds :data:`LOCK_TEXT`. An existing one is taken over only when no run holds it and it is
    a plain file powerlens wrote (a killed run's); anything else at that path (a link, a user's
    file) is refused, untouched."""
    import fcntl
    pid = LOCK_TEXT.format(pid=os.getpid()).encode()
    while True:
        try:
            fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), True
        except FileExistsError:
            fd, created = _open_lock(path, target), False
            if fd is None:
                continue                        # its holder removed it as it finished: create it now
        except OSError as exc:
            raise write_error(target, exc) from None
        if created:
            try:
                os.write(fd, pid)
            except OSError as exc:
                os.unlink(path)
                os.close(fd)
                raise write_error(target, exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _lock_pid(fd) or "?"
            os.close(fd)
            raise ValueError(f"--out {target} is being written by another powerlens run (pid {holder}); "
                             f"wait for it to finish or choose another folder") from None
        try:
            current = os.path.samestat(os.fstat(fd), os.lstat(path))
        except FileNotFoundError:
            current = False
        if not current:
            os.close(fd)                        # its holder removed it as it finished: lock the file there now
            continue
        if not created:
            if _lock_pid(fd) is None:
                os.close(fd)
                raise _not_a_lock(path, target, "a file that powerlens did not write")
            try:                                # a killed run's lock: ours now
                os.ftruncate(fd, 0)
                os.pwrite(fd, pid, 0)
            except OSError as exc:
                os.close(fd)
                raise write_error(target, exc) from None
        return fd


@contextlib.contextmanager
def folder_lock(target: str) -> Iterator[None]:
    """Hold an exclusive lock for writing ``target``: the hidden file ``.NAME.lock`` beside it,
    which exists only while it is held (see :func:`_acquire`).

    A second writer of the same folder is refused at once with a message naming the folder and
    the process that holds it; a link or a file powerlens did not write at the lock's path is
    refused, naming it, and left as it is. Parent folders made for the lock are removed again
    where the run leaves them empty, so a refused or failed run leaves nothing behind. A full
    disk while the lock is held is one line naming the folder.
    """
    parent, name = os.path.split(target)
    path = os.path.join(parent, f".{name}.lock")
    try:
        created = _make_folders(parent)
    except OSError as exc:
        raise write_error(target, exc) from None
    try:
        fd = _acquire(path, target)
        try:
            yield
        except OSError as exc:
            if exc.errno in DISK_FULL:
                raise write_error(target, exc) from None
            raise
        finally:
            with contextlib.suppress(OSError):
                if os.path.samestat(os.fstat(fd), os.lstat(path)):
                    os.unlink(path)             # while still held: no other run holds this file
            os.close(fd)
    finally:
        _remove_empty(created)


STAGING = "partial"      # .NAME.partial-XXXX beside the folder: a run being written
REPLACED = "old"         # .NAME.old-XXXX: the folder it replaces, while the new one moves in
STAGE_MARKER = ".powerlens-staging"
"""The file that marks a staging folder (either kind) as made by powerlens; it holds STAGE_TEXT."""
STAGE_TEXT = "a powerlens staging folder: removed by the next run into the same --out\n"


def _mark_stage(folder: str) -> None:
    write_text(os.path.join(folder, STAGE_MARKER), STAGE_TEXT)


def _is_stage(folder: str) -> bool:
    """True if ``folder`` carries powerlens's staging marker (a plain file holding STAGE_TEXT)."""
    try:
        fd = os.open(os.path.join(folder, STAGE_MARKER), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, 256) == STAGE_TEXT.encode()
    finally:
        os.close(fd)


def remove_stale_staging(target: str) -> None:
    """Delete the hidden staging folders that a killed run left beside ``target`` (call with the
    folder lock held: no live run owns them then). Only folders that carry powerlens's staging
    marker (:data:`STAGE_MARKER`) are removed whole; a ``.NAME.partial-*`` folder without one
    that holds a powerlens output (a run killed as it published) loses only what its marker
    lists; any other folder of those names is the user's, and is left as it is."""
    parent, name = os.path.split(target)
    for entry in os.listdir(parent):
        path = os.path.join(parent, entry)
        if os.path.islink(path) or not os.path.isdir(path):
            continue
        if entry.startswith(f".{name}.{STAGING}-"):
            if _is_stage(path):
                shutil.rmtree(path, ignore_errors=True)
            elif read_marker(path) is not None:
                _discard(path)
        elif entry.startswith(f".{name}.{REPLACED}-") and _is_stage(path):
            if os.path.isdir(os.path.join(path, name)) and not os.path.islink(os.path.join(path, name)):
                _discard(os.path.join(path, name))
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(path, STAGE_MARKER))
                os.rmdir(path)


def _files_below(folder: str) -> list:
    return [os.path.relpath(os.path.join(root, f), folder).replace(os.sep, "/")
            for root, _, files in os.walk(folder) for f in files]


@contextlib.contextmanager
def output_dir(path: str, *, command: str = "powerlens", settings: Optional[dict] = None) -> Iterator[str]:
    """Stage a run's files in a hidden sibling folder; on success it replaces ``path`` whole.

    Used by every command but ``sweep`` and ``reproduce``, which resume into their folders.
    The folder rule is :func:`decide_folder`'s: an absent or empty folder, or one powerlens
    wrote (by any command, with any settings), is replaced as a whole, so old files never sit
    beside new ones; any other folder is refused, and the refusal creates nothing. The marker
    lists the staged files.

    The folder is locked for the whole run (:func:`folder_lock`), staging folders of killed runs
    are removed first, and on any exception ``path`` is left as it was. Folders get the usual
    permissions (0777 less the umask, 0755 typically).
    """
    target = check_out_path(path, command=command)
    parent, name = os.path.split(target)
    with folder_lock(target):
        decide_folder(path, command=command)
        remove_stale_staging(target)
        try:
            stage = tempfile.mkdtemp(prefix=f".{name}.{STAGING}-", dir=parent)
        except OSError as exc:
            raise write_error(path, exc) from None
        try:
            public_mode(stage)
            _mark_stage(stage)
            yield stage
            write_marker(stage, command, settings, files=[f for f in _files_below(stage) if f != STAGE_MARKER])
            os.unlink(os.path.join(stage, STAGE_MARKER))     # marked now: a powerlens output, as published
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
    """Put the folder ``stage`` in place of ``target`` (absent, empty, or one powerlens wrote: see
    :func:`decide_folder`): one atomic swap where the kernel offers it, else two renames (the old
    folder is kept aside until the new one is in). Of the old folder, only what its marker lists
    is deleted."""
    if not os.path.lexists(target):
        os.replace(stage, target)
        return
    if _exchange(stage, target):
        _discard(stage)                              # now holds the old folder
        return
    parent, name = os.path.split(target)
    old = tempfile.mkdtemp(prefix=f".{name}.{REPLACED}-", dir=parent)
    _mark_stage(old)
    os.replace(target, os.path.join(old, name))
    os.replace(stage, target)
    _discard(os.path.join(old, name))
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(old, STAGE_MARKER))
        os.rmdir(old)


def versions() -> dict:
    """Versions of the packages behind a result."""
    import importlib.metadata as md
    import platform
    out = {"python": platform.python_version()}
    for pkg in ("powerlens", "jax", "jaxlib", "optax", "numpy", "scipy", "transformers", "safetensors", "gguf"):
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
