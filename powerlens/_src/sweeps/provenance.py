"""What a sweep's stored rows were computed from, beside the store that keeps them.

    spec_hash(spec, checkpoint, prefix)   sha256 of what every row depends on
    rows_checksum(systems, columns)       sha256 of a chunk's rows as stored
    stamp(rows, spec_hash, chunk)         a chunk as stored: its provenance and its rows
    mismatch(value, ...)                  why a stored chunk is not the chunk asked for (None: it is)
    checkpoint_identity(name)             a model sweep's checkpoint, file by file (every byte hashed)
    folder_spec(spec, checkpoint)         what the output folder's marker records
    sweep_record(spec, result, ...)       sweep.json: the spec, versions, devices, timing

A stored chunk is taken in only if its spec hash, group, index, systems, columns and rows'
checksum all match (:func:`mismatch`); else it is recomputed, and the log says why.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

from .. import io

FORMAT = 1
"""The version of a stored chunk's layout (part of its provenance)."""
HASH_BLOCK = 1 << 23
"""Bytes read at a time when a checkpoint file is hashed: memory stays bounded by this."""


def spec_hash(spec, checkpoint: Optional[dict] = None, prefix: str = "") -> str:
    """sha256 of what a sweep's rows depend on: the normalised spec, the checkpoint of a
    model sweep, the chunk names' prefix and the chunk layout (:data:`FORMAT`)."""
    blob = json.dumps({"spec": spec.to_dict(), "checkpoint": checkpoint, "prefix": prefix, "format": FORMAT},
                      sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def rows_checksum(systems: list, cols: Mapping[str, list]) -> str:
    """sha256 of a chunk's rows as stored (JSON-ready: NaN is null)."""
    blob = json.dumps({"system": systems, "columns": cols}, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def stamp(rows: Mapping[str, Any], spec: str, chunk) -> dict:
    """A chunk as stored: ``{"provenance": {spec, group, chunk, rows}, "system": ids, "columns": ...}``
    from its JSON-ready ``rows`` (``system`` and ``columns``), the sweep's :func:`spec_hash`
    and the :class:`~powerlens._src.sweeps.plan.Chunk`."""
    return {"provenance": {"spec": spec, "group": chunk.group, "chunk": chunk.index,
                           "rows": rows_checksum(rows["system"], rows["columns"])}, **rows}


def mismatch(value, *, spec: str, chunk, ids: Sequence[int], made: set, series: set,
             measured: Sequence[str]) -> Optional[str]:
    """Why a stored ``value`` is not chunk ``chunk`` of the sweep with :func:`spec_hash`
    ``spec`` (None: it is): its provenance (spec hash, group, index), its systems (``ids``),
    its columns (``made``: those every chunk has; ``series``: the series columns it may have;
    ``measured``: those that must hold numbers), its rows' checksum."""
    if not isinstance(value, dict):
        return f"holds {type(value).__name__ if value is not None else 'null'}, not a chunk"
    prov, got, cols = value.get("provenance"), value.get("system"), value.get("columns")
    if not isinstance(prov, dict):
        return "records no provenance"
    if prov.get("spec") != spec:
        return "was computed for another spec (or another checkpoint)"
    if (prov.get("group"), prov.get("chunk")) != (chunk.group, chunk.index):
        return f"is chunk {prov.get('chunk')} of group {prov.get('group')}, not this one"
    if got != list(ids):
        return "holds other systems than this chunk's"
    if not isinstance(cols, dict) or any(not isinstance(v, list) or len(v) != chunk.n for v in cols.values()) \
            or not made <= set(cols):
        return "does not hold one value of every column per system"
    extra = sorted(set(cols) - made - series)
    if extra:
        return f"holds columns this sweep does not make ({', '.join(extra[:3])})"
    odd = next((k for k in measured if any(x is not None and type(x) not in (int, float, bool) for x in cols[k])),
               None)
    if odd is not None:
        return f"holds a value that is not a number in column {odd}"
    try:
        rows = rows_checksum(got, cols)
    except ValueError:                           # a NaN or an infinity: powerlens stores them as null
        return "holds a NaN or infinite value (powerlens stores them as null)"
    if prov.get("rows") != rows:
        return "has rows that do not match its checksum (edited or damaged)"
    return None


def _file_identity(path: str, update: Callable[[int], Any] = lambda n: None) -> Dict[str, Any]:
    """size, mtime_ns and the sha256 of the file's whole content (tensor data included), read
    in blocks of :data:`HASH_BLOCK` bytes; ``update(n)`` is told of every n bytes read."""
    st = os.stat(path)
    digest, buf = hashlib.sha256(), bytearray(HASH_BLOCK)
    view = memoryview(buf)
    with open(path, "rb") as fh:
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            digest.update(view[:n])
            update(n)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest.hexdigest()}


def checkpoint_identity(name: str, progress: bool = False) -> Dict[str, Dict[str, Any]]:
    """What identifies the checkpoint of a [model] sweep, file by file (config, tokenizer and
    weights; see :func:`_file_identity`): every byte is hashed, so a sweep never resumes across
    a changed checkpoint at the same path, even one with the same shapes, size and mtime.
    Hashing reads the whole checkpoint once (about 0.5 GB/s); with ``progress``, a bar on
    standard error shows it when the files exceed 256 MB."""
    from tqdm.auto import tqdm
    from ..models.load import resolve
    path = resolve(name)
    if os.path.isfile(path):
        files = {os.path.basename(path): path}
    else:
        files = {entry: os.path.join(path, entry) for entry in sorted(os.listdir(path))
                 if os.path.isfile(os.path.join(path, entry))
                 and entry.endswith((".safetensors", ".bin", ".gguf", ".json", ".model", ".txt"))}
    total = sum(os.path.getsize(f) for f in files.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"hashing {os.path.basename(path)}", leave=False,
              disable=not progress or total < (256 << 20)) as bar:
        return {entry: _file_identity(full, bar.update) for entry, full in files.items()}


def folder_spec(spec, checkpoint: Optional[dict] = None) -> dict:
    """What the folder's marker records of a sweep: the normalised spec, and for a model sweep
    the checkpoint's identity (``checkpoint``, else read now; a resume refuses a changed one,
    naming its files)."""
    out = spec.to_dict()
    if spec.model is not None:
        out["checkpoint"] = checkpoint if checkpoint is not None else checkpoint_identity(spec.model["name"])
    return out


def sweep_record(spec, result, rows: int, started: Optional[float] = None) -> dict:
    """sweep.json of a finished sweep: its spec, the versions of powerlens and its libraries,
    the devices and processes, the chunks computed, resumed and recomputed, the rows whose
    run went non-finite, the groups, and the timing."""
    return {"spec": spec.to_dict(), "versions": io.versions(), "devices": result.devices,
            "processes": result.processes, "systems": int(rows), "chunks": result.chunks,
            "chunks_computed": result.computed, "chunks_resumed": result.resumed,
            "chunks_recomputed": result.recomputed, "non_finite": result.non_finite, "groups": result.groups,
            "timing": {"seconds": round(time.time() - (started or time.time()), 3),
                       "compute_seconds": round(result.compute_seconds, 3),
                       "systems_computed": result.systems_computed,
                       "systems_per_second": (round(result.systems_computed / result.compute_seconds, 2)
                                              if result.compute_seconds > 0 else None)}}
