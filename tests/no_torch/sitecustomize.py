"""Make torch look uninstalled for a whole Python process (put this folder on PYTHONPATH).

Two parts, because transformers asks ``importlib.util.find_spec("torch")`` whether torch is
installed before it ever imports it:

* ``importlib.util.find_spec`` answers None for ``torch`` and ``torch.*``;
* a ``sys.meta_path`` finder raises ModuleNotFoundError on any import of them.

``sys.modules["torch"] = None`` is deliberately not used: scipy reads that entry as "torch
is loaded" and breaks. At exit the process (and every forked worker) writes ``NO-TORCH-CHECK: <modules>`` to
stderr, listing every ``torch`` module that got imported anyway (none, if the hook held).
"""
import atexit
import importlib.util
import multiprocessing.util
import sys

_find_spec = importlib.util.find_spec


def _blocked(name):
    return name == "torch" or name.startswith("torch.")


def _find_spec_without_torch(name, package=None):
    return None if _blocked(name) else _find_spec(name, package)


class _NoTorch:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if _blocked(name):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: the runtime must not need torch)",
                                      name=name)
        return None


importlib.util.find_spec = _find_spec_without_torch
sys.meta_path.insert(0, _NoTorch())


@atexit.register
def _report():
    loaded = sorted(m for m in sys.modules if _blocked(m))
    sys.stderr.write(f"NO-TORCH-CHECK: {','.join(loaded) or 'none'}\n")


class _Holder:
    """What multiprocessing's after-fork registry keeps (weakly) alive."""


_HOLDER = _Holder()


def _report_in_forked_worker(_):
    """A forked multiprocessing worker (reproduce's, on Linux) ends with os._exit, which skips
    atexit; multiprocessing runs its finalizers first (it clears them, then calls its
    after-fork hooks, so the report is registered from one)."""
    multiprocessing.util.Finalize(None, _report, exitpriority=-1000)


multiprocessing.util.register_after_fork(_HOLDER, _report_in_forked_worker)
