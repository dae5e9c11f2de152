"""Read checkpoint tensors without torch: safetensors (single or sharded) and, only
when torch is installed, ``pytorch_model.bin``.

Tensors are read lazily, one at a time. A safetensors tensor is read with
``readinto`` from the offsets of the file's header straight into its destination (a
64-byte aligned NumPy buffer, or a caller's slot of a stacked array via ``out=``):
no intermediate copy, and on the CPU ``jax.device_put`` of an aligned buffer is
zero-copy (:func:`powerlens.models.convert.to_device`), so a whole checkpoint is held
about once while loading.
Name prefixes such as ``bert.``, ``transformer.`` and ``model.`` are stripped; buffers
(``position_ids``, causal-mask buffers) are skipped by whole dotted name components
(``h.0.attn.bias`` is a buffer, ``h.0.attn.c_attn.bias`` is not). A missing tensor, a
wrong shape, an unsupported dtype or a non-finite value is an error that names the
file and the tensor. fp16/bf16 are upcast to the requested float dtype.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Dict, Iterable, Optional, Sequence, Tuple

import numpy as np

STRIP_PREFIXES = ("bert.", "albert.", "roberta.", "distilbert.", "transformer.", "model.", "gpt_neo.")
SKIP_SUFFIXES = ("position_ids", "attn.bias", "attn.masked_bias", "attention.bias", "attention.masked_bias",
                 "rotary_emb.inv_freq")
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# safetensors dtype -> little-endian NumPy storage dtype (BF16 read as raw uint16 bits)
_ST_NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}
ALIGN = 64   # XLA's CPU client aliases (does not copy) host buffers aligned like this
_FINITE_CHUNK = 1 << 22  # elements per finiteness check (bounds the boolean temporary)


def aligned_empty(shape, dtype, align: int = ALIGN) -> np.ndarray:
    """Uninitialised C-contiguous array whose data pointer is ``align``-byte aligned."""
    shape = tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes].view(dtype).reshape(shape)


def all_finite(a: np.ndarray) -> bool:
    """``np.isfinite(a).all()`` in chunks, so the check allocates little."""
    flat = a.reshape(-1)
    return all(bool(np.isfinite(flat[i:i + _FINITE_CHUNK]).all()) for i in range(0, flat.size, _FINITE_CHUNK))


def _is_buffer(name: str) -> bool:
    return any(name == s or name.endswith("." + s) for s in SKIP_SUFFIXES)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit what the converter expects."""


def _strip(name: str, prefixes: Sequence[str]) -> str:
    changed = True
    while changed:
        changed = False
        for p in prefixes:
            if name.startswith(p):
                name, changed = name[len(p):], True
    return name


class TensorReader:
    """Lazy, name-normalised access to the tensors of one checkpoint folder."""

    def __init__(self, folder: str, *, dtype=np.float32, prefixes: Sequence[str] = STRIP_PREFIXES):
        self.folder = folder
        self.dtype = np.dtype(dtype)
        self._index: Dict[str, Tuple[str, str]] = {}   # stripped name -> (file, original name)
        self._torch_state = None
        self._headers: Dict[str, Tuple[int, dict]] = {}
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
            try:
                with open(index) as fh:
                    shards = sorted(set(json.load(fh)["weight_map"].values()))
            except (OSError, ValueError, KeyError) as exc:
                raise CheckpointError(f"{index}: cannot read the shard index ({exc})") from exc
            paths = [os.path.join(folder, s) for s in shards]
            missing = [p for p in paths if not os.path.isfile(p)]
            if missing:
                raise CheckpointError(f"{index} lists shard(s) that do not exist: {missing}")
            return paths
        if os.path.isfile(binary):
            return [binary]
        raise CheckpointError(
            f"{folder}: no weights found (expected model.safetensors, model.safetensors.index.json "
            f"or pytorch_model.bin)")

    def _names(self, path: str) -> Iterable[str]:
        if path.endswith(".bin"):
            return list(self._load_torch(path).keys())
        from safetensors import safe_open
        try:
            with safe_open(path, "np") as f:
                return list(f.keys())
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc

    def _load_torch(self, path: str):
        if self._torch_state is None:
            try:
                import torch  # noqa: F401  (optional, only for pytorch_model.bin)
            except ImportError:
                raise CheckpointError(
                    f"{path}: this checkpoint is only available as pytorch_model.bin, which needs torch "
                    f"to read; install torch or convert it to model.safetensors") from None
            try:
                self._torch_state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:
                raise CheckpointError(f"{path}: cannot read pytorch_model.bin ({exc})") from exc
        return self._torch_state

    # ------------------------------------------------------------------ access
    def names(self):
        return sorted(self._index)

    def has(self, name: str) -> bool:
        return name in self._index

    def get(self, name: str, shape: Optional[Tuple[int, ...]] = None, *, dtype=None,
            out: Optional[np.ndarray] = None) -> np.ndarray:
        """Tensor ``name`` (prefix-stripped) as a float array of the reader's dtype.

        ``out``: an existing C-contiguous float array (e.g. one layer's slot of a stacked
        array, reshaped to the stored shape) to read into instead of a new aligned array;
        its shape must equal the tensor's. Returns the filled array.

        Raises CheckpointError naming the tensor when it is missing, has another shape,
        an unsupported dtype, or non-finite values.
        """
        if name not in self._index:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
        path, orig = self._index[name]
        out_dtype = np.dtype(out.dtype if out is not None else (dtype if dtype is not None else self.dtype))
        if out is not None:
            if shape is None:
                shape = out.shape
            elif tuple(out.shape) != tuple(shape):
                raise ValueError(f"destination for tensor {name!r} has shape {out.shape}, expected {tuple(shape)}")
        if path.endswith(".bin"):
            t = self._load_torch(path)[orig]
            if not t.is_floating_point():
                raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {t.dtype}")
            arr = t.float().numpy()
            if shape is not None and tuple(arr.shape) != tuple(shape):
                raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
            dst = out if out is not None else aligned_empty(arr.shape, out_dtype)
            dst[...] = arr
            del arr
        else:
            dst = self._read_safetensors(path, orig, name, shape, out_dtype, out)
        if not all_finite(dst):
            raise CheckpointError(f"{path}: tensor {name!r} contains non-finite values (NaN or inf)")
        return dst

    def _header(self, path: str) -> Tuple[int, dict]:
        """(start of the data section, header dict) of a safetensors file."""
        if path not in self._headers:
            try:
                with open(path, "rb") as fh:
                    (n,) = struct.unpack("<Q", fh.read(8))
                    header = json.loads(fh.read(n))
            except (OSError, ValueError, struct.error) as exc:
                raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc
            self._headers[path] = (8 + n, header)
        return self._headers[path]

    def _read_safetensors(self, path, orig, name, shape, out_dtype, out):
        base, header = self._header(path)
        meta = header.get(orig)
        try:
            st_dtype, st_shape = meta["dtype"], tuple(int(s) for s in meta["shape"])
            begin, end = (int(o) for o in meta["data_offsets"])
        except (TypeError, KeyError, ValueError) as exc:
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r} ({exc})") from exc
        if st_dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has unsupported dtype {st_dtype} (expected one of {FLOAT_DTYPES})")
        if shape is not None and st_shape != tuple(shape):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {st_shape}, expected {tuple(shape)}")
        src = np.dtype(_ST_NUMPY[st_dtype])
        count = int(np.prod(st_shape, dtype=np.int64))
        if end - begin != count * src.itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} has {end - begin} bytes for shape {st_shape} {st_dtype}; "
                                  f"the file is corrupt")
        dst = out if out is not None else aligned_empty(st_shape, out_dtype)
        if not dst.flags.c_contiguous:
            raise ValueError(f"destination for tensor {name!r} must be C-contiguous")
        direct = st_dtype != "BF16" and src.newbyteorder("=") == dst.dtype and src.isnative
        buf = dst if direct else np.empty(st_shape, src)
        try:
            with open(path, "rb") as fh:
                fh.seek(base + begin)
                got = fh.readinto(memoryview(buf.reshape(-1).view(np.uint8)))
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({exc})") from exc
        if got != end - begin:
            raise CheckpointError(f"{path}: tensor {name!r} is cut short ({got} of {end - begin} bytes); "
                                  f"the file is truncated or corrupt")
        if not direct:
            if st_dtype == "BF16":   # bf16 = the top 16 bits of a float32
                buf = (buf.astype(np.uint32) << 16).view(np.float32)
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
            return json.load(fh)
    except ValueError as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from exc
