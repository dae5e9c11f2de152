"""Where a sweep's systems come from besides the synthetic builder, found without JAX.

* A custom builder ``builder = "module:function"`` is user code: :func:`host_builder`
  imports its module from an installed package (``sys.path`` without the current
  directory) or from the file ``builder_path`` names (:func:`builder_file`: relative to the
  spec's folder), and runs it as it is.
* A ``[model]`` sweep iterates layers of a checkpoint: :func:`loaded_model` (cached) and
  :func:`model_layers`, the 0-based numbers of the layers it names.

Both :mod:`~powerlens._src.sweeps.spec` (checking a spec) and :mod:`~powerlens._src.sweeps.systems`
(building its rows) use them; this module imports neither.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
from typing import Callable


def builder_file(path: str, source: str) -> str:
    """``builder_path`` as a path: relative to the spec file's folder (to the current
    directory for a spec given as a dict); "" for none."""
    if not path:
        return ""
    if os.path.isabs(path) or source.startswith("<"):
        return os.path.abspath(path)
    return os.path.join(os.path.dirname(os.path.abspath(source)), path)


def _is_here(entry: str) -> bool:
    """Whether a ``sys.path`` entry is the current directory ('' and '.' included)."""
    if entry in ("", "."):
        return True
    try:
        return os.path.realpath(entry) == os.path.realpath(os.getcwd())
    except (OSError, ValueError):
        return False


def _import_installed(module: str):
    """``module`` imported from ``sys.path`` without the current directory (a module that is
    imported already is taken as it is)."""
    top = module.partition(".")[0]
    if top not in sys.modules:
        found = importlib.machinery.PathFinder.find_spec(top, [p for p in sys.path if not _is_here(p)])
        if found is None:
            here = importlib.machinery.PathFinder.find_spec(top, [os.getcwd()])
            hint = (f"; {top!r} lies in the current directory, which is never searched: name its file with "
                    f"builder_path" if here is not None else "")
            raise ImportError(f"no installed module named {top!r}{hint}")
        _exec_module(found, top)
    return importlib.import_module(module)


def _import_file(module: str, path: str):
    """The module in the file ``path`` (a .py file), under the name ``module``."""
    if not os.path.isfile(path):
        raise ImportError(f"builder_path {path!r} is not a file")
    name = f"powerlens_builder_{hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:12]}_{module}"
    if name in sys.modules:
        return sys.modules[name]
    found = importlib.util.spec_from_file_location(name, path)
    if found is None or found.loader is None:
        raise ImportError(f"builder_path {path!r} is not a Python file")
    return _exec_module(found, name)


def _exec_module(found, name: str):
    """Run the module of the import spec ``found`` as ``sys.modules[name]`` (removed again if
    its code raises)."""
    mod = importlib.util.module_from_spec(found)
    sys.modules[name] = mod
    try:
        found.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod


def host_builder(name: str, path: str = "") -> Callable:
    """The user function named by ``builder = "module:function"`` (a ValueError naming it if
    it cannot be had). A builder is user code: importing its module runs that module.

    The module is imported from an installed package, i.e. ``sys.path`` without the current
    directory (so a file that happens to lie where the command runs is never imported), or,
    with ``path`` (the spec's ``builder_path``), from that file.
    """
    module, _, attr = name.partition(":")
    try:
        mod = _import_file(module, path) if path else _import_installed(module)
        fn = getattr(mod, attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"[system] builder {name!r}: cannot import it ({exc})") from None
    except Exception as exc:          # user code: any failure while importing it is one line naming it
        raise ValueError(f"[system] builder {name!r}: importing it failed ({type(exc).__name__}: {exc})") from None
    if not callable(fn):
        raise ValueError(f"[system] builder {name!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


@functools.lru_cache(maxsize=2)
def loaded_model(name: str):
    """The model ``name`` (:func:`powerlens._src.models.load.load`), loaded once per sweep."""
    from ..models.load import load
    return load(name)


def model_layers(spec) -> list:
    """The layers a [model] sweep iterates, as 0-based layer numbers: its list, each checked and
    a negative index counted from the end as in Python (-1: the last layer), or every unique
    layer for ``"all"`` (the model is loaded: cached). The sweep's rows, table, figures and
    report carry these numbers, so ``layers = [-1]`` gives rows of layer U - 1, not -1."""
    name, layers, source = spec.model["name"], spec.model["layers"], spec.source
    U = loaded_model(name).layers.n_unique
    if layers == "all":
        return list(range(U))
    out = []
    for layer in layers:
        if not -U <= layer < U:
            raise ValueError(f"{source}: [model] layers: layer {layer} does not exist ({name} has {U} unique layers: "
                             f"0..{U - 1}, or -{U}..-1 counted from the last)")
        number = layer % U
        if number in out:
            raise ValueError(f"{source}: [model] layers: {list(layers)} names layer {number} twice")
        out.append(number)
    return out
