"""JAX's persistent compilation cache, as every ``powerlens`` command uses it."""
from __future__ import annotations

import os
import sys
from typing import Optional

XLA_CACHE_OFF = ("0", "off", "false", "no")
"""Values of ``POWERLENS_XLA_CACHE`` that turn the cache off."""

MAX_BYTES = 2 ** 30
"""The size bound of the compilation cache, in bytes (least recently used entries go first)."""


def compilation_cache() -> Optional[str]:
    """Keep the command's compiled XLA programs in ``cache_dir()/xla`` (JAX's persistent
    compilation cache), so that a second run with the same shapes skips most compiling:
    ``reproduce --quick`` spends about 60 s of its CPU time in XLA's compiler, a program
    of the measured scan about 2 s of it (0.4-0.7 s from the cache). The entries are keyed
    by JAX on the program, the jax/jaxlib versions and the XLA flags, so results are the
    bytes the compiler would give. Every program is kept, small ones too: a short command
    compiles mostly small ones. Off with ``POWERLENS_XLA_CACHE=off``, and where the
    folder cannot be written; a cache the user chose (``JAX_COMPILATION_CACHE_DIR``) is
    left as it is, but given a size bound when it has none: JAX locks the folder (a file lock
    around every read and write) only when its size is bounded, and without the lock a process
    that reads an entry another process is writing (``sweep --processes``, reproduce's workers)
    can load a truncated program. Set through the environment too, so worker processes use the
    same cache. Returns the folder, or None when off."""
    if os.environ.get("POWERLENS_XLA_CACHE", "").strip().lower() in XLA_CACHE_OFF:
        return None
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        _configure({"jax_compilation_cache_max_size": MAX_BYTES})
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    from ..io import cache_dir
    folder = os.path.join(cache_dir(), "xla")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None                   # no cache where it cannot be written (JAX would warn on every compile)
    if not os.access(folder, os.W_OK):
        return None
    _configure({"jax_compilation_cache_dir": folder,
                # every program: a one-prompt align compiles 18, 15 of them small, which together
                # took longer to compile than the scan's (about 0.25 s against 0.2 s) and read back in a few ms each
                "jax_persistent_cache_min_compile_time_secs": 0.0,
                "jax_compilation_cache_max_size": MAX_BYTES})     # least recently used go first; locked
    return folder


def _configure(settings: dict) -> None:
    """Each JAX setting ``name: value`` that the environment does not set already, through the
    environment (JAX reads each from the variable of its name in capitals, here and in worker
    processes) and, when JAX is imported already, its config."""
    for name, value in settings.items():
        os.environ.setdefault(name.upper(), str(value))
        if "jax" in sys.modules:                 # imported already: its config read the environment before
            sys.modules["jax"].config.update(name, type(value)(os.environ[name.upper()]))
