"""Read checkpoint tensors without torch: safetensors (single or sharded) and, only
when torch is installed, ``pytorch_model.bin``.

Tensors are read lazily, one at a time, straight into NumPy (no second copy); name
prefixes such as ``bert.``, ``transformer.`` and ``model.`` are stripped; integer
buffers (``position_ids``, causal-mask buffers) are skipped. A missing tensor, a
wrong shape, an unsupported dtype or a non-finite value is an error that names the
file and the tensor. fp16/bf16 are upcast to the requested float dtype.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Iterable, Optional, Sequence, Tuple

import numpy as np

STRIP_PREFIXES = ("bert.", "albert.", "roberta.", "distilbert.", "transformer.", "model.", "gpt_neo.")
SKIP_SUFFIXES = ("position_ids", "attn.bias", "attn.masked_bias", "attention.bias", "attention.masked_bias",
                 "rotary_emb.inv_freq")
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


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
        files = self._weight_files(folder)
        self.files = files
        for path in files:
            for name in self._names(path):
                if any(name.endswith(s) for s in SKIP_SUFFIXES):
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

    def get(self, name: str, shape: Optional[Tuple[int, ...]] = None, *, dtype=None) -> np.ndarray:
        """Tensor ``name`` (prefix-stripped) as a float array of the reader's dtype.

        Raises CheckpointError naming the tensor when it is missing, has another shape,
        an unsupported dtype, or non-finite values.
        """
        if name not in self._index:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
        path, orig = self._index[name]
        if path.endswith(".bin"):
            t = self._load_torch(path)[orig]
            if not t.is_floating_point():
                raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {t.dtype}")
            arr = t.float().numpy()
        else:
            from safetensors import safe_open
            try:
                with safe_open(path, "np") as f:
                    sl = f.get_slice(orig)
                    st_dtype = sl.get_dtype()
                    if st_dtype not in FLOAT_DTYPES:
                        raise CheckpointError(
                            f"{path}: tensor {name!r} has unsupported dtype {st_dtype} (expected one of {FLOAT_DTYPES})")
                    if st_dtype == "BF16":
                        arr = _read_bf16(f, orig, sl)
                    else:
                        arr = f.get_tensor(orig)
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(f"{path}: cannot read tensor {name!r} ({exc}); the file may be truncated or corrupt") from exc
        out_dtype = np.dtype(dtype) if dtype is not None else self.dtype
        if arr.dtype != out_dtype:
            arr = arr.astype(out_dtype)
        if shape is not None and tuple(arr.shape) != tuple(shape):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
        if not np.all(np.isfinite(arr)):
            raise CheckpointError(f"{path}: tensor {name!r} contains non-finite values (NaN or inf)")
        return arr

    def maybe(self, name: str, shape=None) -> Optional[np.ndarray]:
        return self.get(name, shape) if self.has(name) else None


def _read_bf16(f, name, sl):
    """bf16 -> float32 without torch: numpy has no bfloat16, so read raw bits via ml_dtypes."""
    try:
        import ml_dtypes  # shipped with jax
    except ImportError:  # pragma: no cover
        raise CheckpointError(f"tensor {name!r} is bfloat16 and ml_dtypes is not installed")
    from safetensors import safe_open  # noqa: F401
    arr = f.get_tensor(name)  # safetensors >= 0.4 returns ml_dtypes.bfloat16 arrays
    return np.asarray(arr).astype(np.float32)


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
