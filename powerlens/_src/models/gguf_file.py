"""One GGUF file (llama.cpp format): its metadata and its tensors, dequantised with the
``gguf`` package, every error a :class:`~powerlens._src.models.reader.CheckpointError` naming the
file. GGUF lists dimensions innermost first: a tensor of GGUF shape ``[d_in, d_out]`` is
the NumPy array (d_out, d_in). The converter (:mod:`~powerlens._src.models.gguf_llama`) and the
tokenizer (:mod:`~powerlens._src.models.gguf_tokenizer`) both read files through :class:`GGUFFile`.
"""
from __future__ import annotations

import mmap
import os
import struct
import sys
from typing import Optional

import numpy as np

from .convert import short_repr
from .reader import CheckpointError, aligned_empty, one_line


def _reader_class():
    """``gguf.GGUFReader`` parsing through a plain ndarray view of its memory map.

    The stock reader slices an ``np.memmap`` once per metadata item, and the memmap
    subclass hooks make parsing a 50k-entry vocabulary take seconds; slicing a plain
    view of the same mapping gives the same arrays several times faster. A read past the
    end of the file is an error (the stock reader returns an empty array there, and an
    array field of scalars whose declared length runs past the end then loops for as many
    items as that length says). Falls back to the stock reader if the private ``_get``
    hook ever changes.
    """
    import gguf
    import inspect
    base = gguf.GGUFReader
    try:
        params = list(inspect.signature(base._get).parameters)
    except (AttributeError, TypeError, ValueError):
        return base
    try:
        field_params = list(inspect.signature(base._get_field_parts).parameters)
    except (AttributeError, TypeError, ValueError):
        return base
    if params[:5] != ["self", "offset", "dtype", "count", "override_order"] or \
            field_params != ["self", "orig_offs", "raw_type"]:
        return base

    class _PlainViewReader(base):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None or plain.base is not self.data:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            count = int(count)
            itemsize = int(np.dtype(dtype).itemsize)
            if offset < 0 or count < 0 or offset + itemsize * count > plain.shape[0]:
                raise ValueError(f"{count} item(s) of {np.dtype(dtype)} at offset {offset} run past the end "
                                 f"of the file ({plain.shape[0]} bytes)")
            arr = plain[offset:offset + itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _get_field_parts(self, orig_offs, raw_type):
            """Arrays in bulk: a scalar array is one part (``contents()`` reads it the same),
            a string array is walked with ``struct`` (Gemma's 262,144-token vocabulary: about
            0.5 s instead of 20 s); anything else as the stock reader does."""
            if raw_type != gguf.GGUFValueType.ARRAY:
                return base._get_field_parts(self, orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            itype, n, offs = int(raw_itype[0]), int(alen[0]), orig_offs + 12
            try:
                sub = gguf.GGUFValueType(itype)
            except ValueError:
                return base._get_field_parts(self, orig_offs, raw_type)
            nptype = self.gguf_scalar_to_np.get(sub)
            types = [gguf.GGUFValueType.ARRAY] + ([sub] if n else [])
            if nptype is not None:
                vals = self._get(offs, nptype, n)
                return 12 + int(vals.nbytes), [raw_itype, alen, vals], [2], types
            if sub != gguf.GGUFValueType.STRING:
                return base._get_field_parts(self, orig_offs, raw_type)
            self._get(orig_offs, np.uint8)                       # makes the plain view
            plain = self.__dict__["_plain"]
            swapped = (self.byte_order == "S") == (sys.byteorder == "little")
            fmt, u64 = (">Q" if swapped else "<Q"), np.dtype(np.uint64).newbyteorder(self.byte_order)
            size, parts, idxs, unpack = plain.shape[0], [raw_itype, alen], [], struct.unpack_from
            for _ in range(n):
                if offs + 8 > size:
                    raise ValueError(f"a string at offset {offs} runs past the end of the file ({size} bytes)")
                (ln,) = unpack(fmt, plain, offs)
                if offs + 8 + ln > size:
                    raise ValueError(f"a string of {ln} bytes at offset {offs} runs past the end of the file "
                                     f"({size} bytes)")
                parts.append(plain[offs:offs + 8].view(u64))
                parts.append(plain[offs + 8:offs + 8 + ln])
                idxs.append(len(parts) - 1)
                offs += 8 + ln
            return offs - orig_offs, parts, idxs, types

    return _PlainViewReader


class GGUFFile:
    """Metadata and dequantised tensors of one GGUF file, with errors naming the file."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: GGUF file not found")
        try:
            with np.errstate(over="ignore"):   # a corrupt offset overflows; the read past the end reports it
                self.reader = _reader_class()(path)
        except Exception as exc:  # gguf raises ValueError/IndexError/struct errors on bad bytes
            raise CheckpointError(
                f"{path}: not a readable GGUF file ({type(exc).__name__}: {one_line(exc)}); "
                f"the file may be truncated or corrupt") from exc
        self.tensors = {t.name: t for t in self.reader.tensors}

    def meta(self, key: str, default=None, *, required: bool = False):
        if getattr(self, "_dropped", False):
            raise RuntimeError(f"{self.path}: metadata {key!r} read after drop_metadata()")
        field = self.reader.get_field(key)
        if field is None:
            if required:
                raise CheckpointError(f"{self.path}: GGUF metadata key {key!r} is missing")
            return default
        try:
            return field.contents()
        except Exception as exc:
            raise CheckpointError(f"{self.path}: cannot read GGUF metadata key {key!r} ({one_line(exc)})") from exc

    def meta_int(self, key: str, default=None, *, minimum: int = 1, maximum: Optional[int] = None) -> int:
        """An integer metadata value >= ``minimum`` (and <= ``maximum`` when given; required when
        ``default`` is None)."""
        value = self.meta(key, default, required=default is None)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
            raise CheckpointError(f"{self.path}: GGUF metadata {key}={short_repr(value)} "
                                  f"must be an integer >= {minimum}")
        if maximum is not None and value > maximum:
            raise CheckpointError(f"{self.path}: GGUF metadata {key}={int(value)} is too large (at most {maximum})")
        return int(value)

    def meta_float(self, key: str, default=None) -> float:
        """A finite positive number (required when ``default`` is None)."""
        value = self.meta(key, default, required=default is None)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not 0 < value < np.inf:
            raise CheckpointError(f"{self.path}: GGUF metadata {key}={short_repr(value)} must be a positive number")
        return float(value)

    def release_pages(self) -> None:
        """Drop the already-read pages of the memory-mapped file from this process's
        resident memory (they stay in the OS page cache; reading again faults them back)."""
        mm = getattr(self.reader.data, "_mmap", None)
        if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            try:
                mm.madvise(mmap.MADV_DONTNEED)
            except OSError:  # pragma: no cover - advisory only
                pass

    def drop_metadata(self) -> None:
        """Free the parsed metadata (the tokenizer's per-token arrays are most of it); the
        tensors stay readable, and :meth:`meta` is an error from now on."""
        self.reader.fields.clear()
        self._dropped = True

    def has(self, name: str) -> bool:
        return name in self.tensors

    def check(self, name: str, shape):
        """The tensor ``name``, checked to exist with ``shape`` (from its header, nothing read)."""
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the GGUF file")
        shape = tuple(int(s) for s in shape)
        gshape = tuple(int(s) for s in reversed(list(t.shape)))   # GGUF lists dims innermost first
        if gshape != shape:
            raise CheckpointError(f"{self.path}: tensor {name!r} has shape {gshape} "
                                  f"(GGUF dims {list(map(int, t.shape))}), expected {shape}")
        return t

    def get(self, name: str, shape, out: Optional[np.ndarray] = None, *, chunk_rows: int = 4096,
            dtype=np.float32) -> np.ndarray:
        """Tensor ``name`` dequantised (float32 math), checked for shape and finiteness.

        With ``out`` (an array of ``shape``, e.g. one slot of a stacked array) the rows are
        dequantised ``chunk_rows`` at a time straight into it, so no full-size temporary
        is made; otherwise a new array of ``dtype`` is returned.
        """
        t = self.check(name, shape)
        shape = tuple(int(s) for s in shape)
        if out is None:
            out = aligned_empty(shape, dtype, what=f"{self.path}: tensor {name!r}")
        data = t.data
        rows = data.shape[0] if data.ndim > 1 else 1
        for r0 in range(0, rows, chunk_rows):
            block = data[r0:r0 + chunk_rows] if data.ndim > 1 else data
            deq = self._dequantize(name, t, block)
            if not np.all(np.isfinite(deq)):
                raise CheckpointError(f"{self.path}: tensor {name!r} contains non-finite values (NaN or inf)")
            try:
                if data.ndim > 1:
                    out[r0:r0 + chunk_rows] = deq.reshape((-1,) + shape[1:])
                else:
                    out[...] = deq.reshape(shape)
            except ValueError as exc:
                raise CheckpointError(f"{self.path}: tensor {name!r} does not dequantise to shape {shape} "
                                      f"({exc}); the file may be corrupt") from exc
        return out

    def _dequantize(self, name, t, block):
        import gguf
        try:
            return gguf.quants.dequantize(block, t.tensor_type)
        except NotImplementedError as exc:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has quantisation type {t.tensor_type.name}, which the gguf "
                f"package cannot dequantise ({exc})") from exc
        except Exception as exc:
            raise CheckpointError(f"{self.path}: cannot dequantise tensor {name!r} ({exc}); "
                                  f"the file may be corrupt") from exc
