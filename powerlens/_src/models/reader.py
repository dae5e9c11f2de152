"""Read checkpoint tensors without torch: safetensors (single or sharded) and, only
when torch is installed, ``pytorch_model.bin``.

Tensors are read lazily, one at a time. A safetensors tensor is read with
``readinto`` from the offsets of the file's header straight into its destination (a
64-byte aligned NumPy buffer, or a caller's slot of a stacked array via ``out=``):
no intermediate copy, and on the CPU ``jax.device_put`` of an aligned buffer is
zero-copy (:func:`powerlens._src.models.convert.to_device`), so a whole checkpoint is held
about once while loading.
Name prefixes such as ``bert.``, ``transformer.`` and ``model.`` are stripped; buffers
(``position_ids``, causal-mask buffers) are skipped by whole dotted name components
(``h.0.attn.bias`` is a buffer, ``h.0.attn.c_attn.bias`` is not). A missing tensor, a
wrong shape, an unsupported dtype or a non-finite value is an error that names the
file and the tensor.

Dtypes: with ``dtype=None`` every tensor keeps the dtype it is stored in (F32 -> float32,
F16 -> float16, BF16 -> ``ml_dtypes.bfloat16``, F64 -> float64), so a bf16 checkpoint is
held in bf16; a given ``dtype`` converts each tensor to it as it is read (one tensor at a
time, never the whole checkpoint). :meth:`TensorReader.rows` reads single rows of a
tensor (token directions read from the unembedding) by their file offsets.

Nothing large is allocated on the word of a file: a header entry must lie inside the
file before its tensor is read, and every allocation made on a file's behalf is checked
first against the memory this process can still get (:func:`check_allocation`).
"""
from __future__ import annotations

import json
import os
import pickle
import re
import struct
import warnings
from typing import Dict, Iterable, Optional, Sequence, Tuple

import numpy as np

STRIP_PREFIXES = ("bert.", "albert.", "roberta.", "distilbert.", "transformer.", "model.", "gpt_neo.")
SKIP_SUFFIXES = ("position_ids", "attn.bias", "attn.masked_bias", "attention.bias", "attention.masked_bias",
                 "rotary_emb.inv_freq")
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# safetensors dtype -> little-endian NumPy storage dtype (BF16 read as raw uint16 bits)
_ST_NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}
ALIGN = 64   # XLA's CPU client aliases (does not copy) host buffers aligned like this
STORED_DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16)}
_FINITE_CHUNK = 1 << 22  # elements per finiteness check (bounds the boolean temporary)
MAX_HEADER = 100 << 20   # the safetensors format's own limit on the JSON header


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit what the converter expects."""


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message as one line of at most ``limit`` characters (for wrapping)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def human_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover


def _address_space_left() -> Optional[int]:
    """What ``RLIMIT_AS`` still allows this process to map, or None without a limit."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/statm") as fh:
            used = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        return max(int(soft) - used, 0)
    except (ImportError, OSError, ValueError, IndexError):
        return None


def available_memory() -> Optional[int]:
    """Bytes this process can still allocate: the machine's available memory (psutil when
    installed, else free pages), capped by ``RLIMIT_AS``; None when neither is known."""
    try:
        import psutil
        avail = int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - psutil is optional; fall back to sysconf
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = None
    limit = _address_space_left()
    known = [a for a in (avail, limit) if a is not None]
    return min(known) if known else None


def check_allocation(nbytes: int, what: str) -> None:
    """CheckpointError naming ``what`` when ``nbytes`` exceed the memory available."""
    avail = available_memory()
    if avail is not None and nbytes > avail:
        raise CheckpointError(f"{what} needs {human_bytes(nbytes)}, more than the {human_bytes(avail)} of memory "
                              f"available; the file declares more than it can hold, or the machine is too small")


def aligned_empty(shape, dtype, align: int = ALIGN, *, what: Optional[str] = None) -> np.ndarray:
    """Uninitialised C-contiguous array whose data pointer is ``align``-byte aligned.

    The size is checked first with :func:`check_allocation` (``what`` names the array in
    the error; default: its shape and dtype)."""
    shape = tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
    check_allocation(nbytes + align, what or f"an array of shape {shape} {dtype}")
    raw = np.empty(nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes].view(dtype).reshape(shape)


def bfloat16() -> np.dtype:
    """NumPy's bfloat16 (``ml_dtypes``, a JAX dependency)."""
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


def stored_dtype(st_dtype: str) -> np.dtype:
    """The NumPy dtype a safetensors dtype name (``F32``, ``BF16``, ...) is held in."""
    return bfloat16() if st_dtype == "BF16" else STORED_DTYPES[st_dtype]


FLOAT_NAMES = ("float64", "float32", "float16", "bfloat16")


def float_dtype(dtype, what: str = "dtype") -> np.dtype:
    """``dtype`` (a name such as ``"bfloat16"``, a NumPy or JAX dtype) as a NumPy float dtype of
    :data:`FLOAT_NAMES`; a ValueError naming ``what`` otherwise."""
    try:
        dt = bfloat16() if isinstance(dtype, str) and dtype in ("bfloat16", "bf16") else np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in FLOAT_NAMES:
        raise ValueError(f"{what}={dtype!r} is not one of {', '.join(FLOAT_NAMES)}")
    return dt


def all_finite(a: np.ndarray) -> bool:
    """``np.isfinite(a).all()`` in chunks, so the check allocates little (float16/bfloat16 are
    checked in float32, chunk by chunk)."""
    flat = a.reshape(-1)
    wide = flat.dtype.itemsize < 4

    def ok(part):
        return bool(np.isfinite(part.astype(np.float32) if wide else part).all())
    return all(ok(flat[i:i + _FINITE_CHUNK]) for i in range(0, flat.size, _FINITE_CHUNK))


def _is_buffer(name: str) -> bool:
    return any(name == s or name.endswith("." + s) for s in SKIP_SUFFIXES)


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _inside(shard) -> bool:
    """True for a relative path that stays inside its folder (``a.safetensors``, ``sub/a``)."""
    if not isinstance(shard, str) or not shard or "\x00" in shard or os.path.isabs(shard):
        return False
    norm = os.path.normpath(shard)
    return norm not in (".", "..") and not norm.startswith(".." + os.sep)


def shard_files(folder: str, index: str):
    """The shard paths listed by a ``model.safetensors.index.json``, each checked to be a
    file inside ``folder`` (an absolute path or ``..`` is refused before anything is opened)."""
    try:
        with open(index) as fh:
            doc = json.load(fh)
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{index}: cannot read the shard index ({one_line(exc)})") from exc
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: 'weight_map' must be a non-empty JSON object mapping tensor names to "
                              f"shard files, got {_kind(weight_map)}")
    for shard in weight_map.values():
        if not _inside(shard):
            raise CheckpointError(f"{index}: refusing shard {shard!r}: a shard must be a file name relative to the "
                                  f"model folder, not a path outside it")
    paths = [os.path.join(folder, s) for s in sorted(set(weight_map.values()))]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise CheckpointError(f"{index} lists shard(s) that do not exist: {missing}")
    return paths


def _kind(value) -> str:
    return "nothing" if value is None else f"a JSON {type(value).__name__} ({repr(value)[:40]})"


_UNPICKLER_REASON = re.compile(r"WeightsUnpickler error:\s*(.*?)\s*(?:Check the documentation|$)", re.S)


def unsafe_pickle_reason(exc: BaseException) -> str:
    """The short reason in torch's ``weights_only`` rejection (one line)."""
    m = _UNPICKLER_REASON.search(str(exc))
    return one_line(m.group(1) if m and m.group(1).strip() else exc, 160)


def _strip(name: str, prefixes: Sequence[str]) -> str:
    changed = True
    while changed:
        changed = False
        for p in prefixes:
            if name.startswith(p):
                name, changed = name[len(p):], True
    return name


class TensorReader:
    """Lazy, name-normalised access to the tensors of one checkpoint folder.

    ``dtype``: what :meth:`get` returns; None keeps each tensor's stored dtype
    (:func:`stored_dtype`)."""

    def __init__(self, folder: str, *, dtype=np.float32, prefixes: Sequence[str] = STRIP_PREFIXES):
        self.folder = folder
        self.dtype = None if dtype is None else np.dtype(dtype)
        self._index: Dict[str, Tuple[str, str]] = {}   # stripped name -> (file, original name)
        self._torch_state = None
        self._headers: Dict[str, Tuple[int, dict, int]] = {}   # path -> (data start, header, data size)
        files = self._weight_files(folder)
        self.files = files
        for path in files:
            for name in self._names(path):
                if _is_buffer(name):
                    continue
                self._index[_strip(name, prefixes)] = (path, name)

    # ------------------------------------------------------------------ discovery
    @staticmethod
    def _weight_files(folder: str):
        single = os.path.join(folder, "model.safetensors")
        index = os.path.join(folder, "model.safetensors.index.json")
        binary = os.path.join(folder, "pytorch_model.bin")
        if os.path.isfile(single):
            return [single]
        if os.path.isfile(index):
            return shard_files(folder, index)
        if os.path.isfile(binary):
            return [binary]
        raise CheckpointError(
            f"{folder}: no weights found (expected model.safetensors, model.safetensors.index.json "
            f"or pytorch_model.bin)")

    def _names(self, path: str) -> Iterable[str]:
        if path.endswith(".bin"):
            return list(self._load_torch(path).keys())
        # the names from the header alone: an entry is checked when its tensor is read
        # (:meth:`_entry`), so a corrupt tensor that a command never reads does not stop it
        return [k for k in self._header(path)[1] if k != "__metadata__"]

    def _load_torch(self, path: str):
        if self._torch_state is None:
            try:
                import torch  # noqa: F401  (optional, only for pytorch_model.bin)
            except ImportError:
                raise CheckpointError(
                    f"{path}: this checkpoint is only available as pytorch_model.bin, which needs torch "
                    f"to read; install torch or convert it to model.safetensors") from None
            try:
                with warnings.catch_warnings():   # torch warns (several lines) about unusual pickle protocols
                    warnings.simplefilter("ignore")
                    state = torch.load(path, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as exc:
                raise CheckpointError(f"{path}: refused: the pickle holds more than tensors, and powerlens never "
                                      f"runs checkpoint code ({unsafe_pickle_reason(exc)}); convert the file to "
                                      f"model.safetensors with a trusted tool") from None
            except Exception as exc:
                raise CheckpointError(f"{path}: cannot read pytorch_model.bin ({one_line(exc)})") from None
            bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)] \
                if isinstance(state, dict) else None
            if bad is None or bad:
                raise CheckpointError(f"{path}: expected a state dict of named tensors, "
                                      f"got {type(state).__name__}" + (f" with entries {bad[:3]!r}" if bad else ""))
            self._torch_state = state
        return self._torch_state

    # ------------------------------------------------------------------ access
    def names(self):
        return sorted(self._index)

    def has(self, name: str) -> bool:
        return name in self._index

    def get(self, name: str, shape: Optional[Tuple[int, ...]] = None, *, dtype=None,
            out: Optional[np.ndarray] = None) -> np.ndarray:
        """Tensor ``name`` (prefix-stripped) as a float array of ``dtype`` (default: the reader's;
        None: the dtype it is stored in).

        ``out``: an existing C-contiguous float array (e.g. one layer's slot of a stacked
        array, reshaped to the stored shape) to read into instead of a new aligned array;
        its shape must equal the tensor's. Returns the filled array.

        Raises CheckpointError naming the tensor when it is missing, has another shape,
        an unsupported dtype, or non-finite values.
        """
        if out is not None:
            out_dtype = out.dtype
        elif dtype is not None or self.dtype is not None:
            out_dtype = np.dtype(dtype if dtype is not None else self.dtype)
        else:
            out_dtype = self.stored_dtype(name)
        if out is not None:
            if shape is None:
                shape = out.shape
            elif tuple(out.shape) != tuple(shape):
                raise ValueError(f"destination for tensor {name!r} has shape {out.shape}, expected {tuple(shape)}")
        stored = self.check(name, shape)
        path, orig = self._index[name]
        if path.endswith(".bin"):
            dst = out if out is not None else self._empty(path, name, stored, out_dtype)
            t = self._load_torch(path)[orig]
            dst[...] = (t.double() if t.dtype.itemsize == 8 else t.float()).numpy()
        else:
            dst = self._read_safetensors(path, orig, name, out_dtype, out)
        if not all_finite(dst):
            raise CheckpointError(f"{path}: tensor {name!r} contains non-finite values (NaN or inf)")
        return dst

    def stored_dtype(self, name: str) -> np.dtype:
        """The NumPy dtype tensor ``name`` is stored in (read from the header, nothing else)."""
        if name not in self._index:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
        path, orig = self._index[name]
        if path.endswith(".bin"):
            t = self._load_torch(path)[orig]
            return {8: np.dtype(np.float64), 2: bfloat16() if "bfloat16" in str(t.dtype) else np.dtype(np.float16)
                    }.get(t.dtype.itemsize, np.dtype(np.float32))
        return stored_dtype(self._entry(path, orig, name)[0])

    def nbytes(self, name: str) -> int:
        """Bytes tensor ``name`` takes in its stored dtype (from the header)."""
        return int(np.prod(self.check(name), dtype=object)) * self.stored_dtype(name).itemsize

    def rows(self, name: str, rows, *, dtype=None) -> np.ndarray:
        """Rows ``rows`` "int[K]" of the 2-D tensor ``name`` "[R C]" as "[K C]", each row read by
        its offset in the file (a safetensors file; other formats read the tensor), nothing else
        of the tensor. ``dtype``: as in :meth:`get`. An index outside [0, R) is a ValueError."""
        stored = self.check(name)
        if len(stored) != 2:
            raise CheckpointError(f"{self.folder}: tensor {name!r} has shape {stored}, expected a matrix")
        idx = np.asarray(rows, np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= stored[0]):
            raise ValueError(f"row index out of range [0, {stored[0]}) for tensor {name!r}")
        out_dtype = np.dtype(dtype) if dtype is not None else (self.dtype or self.stored_dtype(name))
        path, orig = self._index[name]
        if path.endswith(".bin"):
            return np.asarray(self.get(name, dtype=out_dtype)[idx])
        base = self._header(path)[0]
        st_dtype, _, begin, _ = self._entry(path, orig, name)
        src = np.dtype(_ST_NUMPY[st_dtype])
        width = stored[1] * src.itemsize
        raw = np.empty((idx.size, stored[1]), src)
        try:
            with open(path, "rb") as fh:
                for k, r in enumerate(idx):
                    fh.seek(base + begin + int(r) * width)
                    if fh.readinto(memoryview(raw[k].view(np.uint8))) != width:
                        raise CheckpointError(f"{path}: tensor {name!r} is cut short at row {int(r)}")
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({one_line(exc)})") from exc
        held = raw.view(bfloat16()) if st_dtype == "BF16" else raw.astype(src.newbyteorder("="))
        out = held.astype(out_dtype)
        if not all_finite(out):
            raise CheckpointError(f"{path}: tensor {name!r} contains non-finite values (NaN or inf)")
        return out

    def check(self, name: str, shape: Optional[Tuple[int, ...]] = None) -> Tuple[int, ...]:
        """The stored shape of tensor ``name``, read from the file's header without reading the
        tensor; a CheckpointError naming it when it is missing, of a non-float dtype, of
        another ``shape``, or (safetensors) described by a header entry that does not fit the file."""
        if name not in self._index:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
        path, orig = self._index[name]
        if path.endswith(".bin"):
            t = self._load_torch(path)[orig]
            if not t.is_floating_point():
                raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {t.dtype}")
            stored = tuple(int(s) for s in t.shape)
        else:
            stored = self._entry(path, orig, name)[1]
        if shape is not None and stored != tuple(shape):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {stored}, expected {tuple(shape)}")
        return stored

    @staticmethod
    def _empty(path, name, shape, dtype) -> np.ndarray:
        return aligned_empty(shape, dtype, what=f"{path}: tensor {name!r} of shape {tuple(shape)}")

    def _header(self, path: str) -> Tuple[int, dict, int]:
        """(start of the data section, header dict, size of the data section) of a safetensors file."""
        if path not in self._headers:
            try:
                with open(path, "rb") as fh:
                    size = os.fstat(fh.fileno()).st_size
                    (n,) = struct.unpack("<Q", fh.read(8))
                    if n > min(MAX_HEADER, size - 8):
                        raise ValueError(f"header length {n} exceeds the file or the format's limit")
                    header = json.loads(fh.read(n))
            except (OSError, ValueError, RecursionError, struct.error) as exc:
                raise CheckpointError(f"{path}: not a readable safetensors file ({one_line(exc)})") from exc
            if not isinstance(header, dict):
                raise CheckpointError(f"{path}: not a readable safetensors file (the header is not a JSON object)")
            self._headers[path] = (8 + n, header, size - 8 - n)
        return self._headers[path]

    def _entry(self, path, orig, name):
        """(dtype, shape, begin, end) of a header entry, checked against the data section."""
        _, header, data_size = self._header(path)
        meta = header.get(orig)
        try:
            st_dtype, st_shape = meta["dtype"], tuple(meta["shape"])
            begin, end = meta["data_offsets"]
        except (TypeError, KeyError, ValueError) as exc:
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r} ({one_line(exc)})") from exc
        if not all(_is_count(v) for v in st_shape + (begin, end)):
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r} (shape {list(st_shape)!r}, "
                                  f"data_offsets {[begin, end]!r}: expected non-negative integers)")
        if st_dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has unsupported dtype {st_dtype} (expected one of {FLOAT_DTYPES})")
        count = int(np.prod(st_shape, dtype=object))
        if end - begin != count * np.dtype(_ST_NUMPY[st_dtype]).itemsize or end > data_size:
            raise CheckpointError(f"{path}: tensor {name!r} has {end - begin} bytes at [{begin}, {end}) for shape "
                                  f"{st_shape} {st_dtype} in a data section of {data_size} bytes; the file is corrupt")
        return st_dtype, st_shape, begin, end

    def _read_safetensors(self, path, orig, name, out_dtype, out):
        base = self._header(path)[0]
        st_dtype, st_shape, begin, end = self._entry(path, orig, name)
        src = np.dtype(_ST_NUMPY[st_dtype])
        dst = out if out is not None else self._empty(path, name, st_shape, out_dtype)
        if not dst.flags.c_contiguous:
            raise ValueError(f"destination for tensor {name!r} must be C-contiguous")
        held = stored_dtype(st_dtype)
        direct = src.isnative and held == dst.dtype        # the stored bytes are the destination's
        buf = dst.view(src) if direct else np.empty(st_shape, src)
        try:
            with open(path, "rb") as fh:
                fh.seek(base + begin)
                got = fh.readinto(memoryview(buf.reshape(-1).view(np.uint8)))
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({one_line(exc)})") from exc
        if got != end - begin:
            raise CheckpointError(f"{path}: tensor {name!r} is cut short ({got} of {end - begin} bytes); "
                                  f"the file is truncated or corrupt")
        if not direct:
            if st_dtype == "BF16":   # bf16 = the top 16 bits of a float32
                buf = buf.view(held) if dst.dtype.itemsize < 4 else (buf.astype(np.uint32) << 16).view(np.float32)
            dst[...] = buf.reshape(st_shape)
            del buf
        return dst

    def maybe(self, name: str, shape=None) -> Optional[np.ndarray]:
        return self.get(name, shape) if self.has(name) else None


def read_config(folder: str) -> dict:
    """``config.json`` of a Hugging Face folder, with a clear error when absent or broken."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{folder}: config.json is missing (not a Hugging Face model folder)")
    try:
        with open(path) as fh:
            config = json.load(fh)
    except (OSError, ValueError, RecursionError) as exc:   # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"{path}: invalid JSON ({one_line(exc)})") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: config.json must be a JSON object of model attributes, got {_kind(config)}")
    return config
