"""What every section of ``powerlens reproduce`` runs with (:class:`Context`: the output
folder, the chunk store, the settings, progress) and the list of sections
(:func:`all_sections`). The command (:mod:`powerlens._src.reproduce`) and its worker processes
(:mod:`~powerlens._src.reproduce.workers`) both build them.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Dict, List

from .. import io

if TYPE_CHECKING:
    from ..sweeps.store import ChunkFolder


@dataclasses.dataclass
class Context:
    out: str
    store: "ChunkFolder"            # the one chunk store (powerlens._src.sweeps.store)
    quick: bool
    seed: int
    models: List[str]
    show_progress: bool = True
    pending: Dict[str, Future] = dataclasses.field(default_factory=dict)   # model -> its worker (--jobs)

    def model_chunk(self, model: str, key: str, compute: Callable[[], Any]) -> Any:
        """Chunk ``key`` of real model ``model``. When a worker process is computing that
        model's chunks (:mod:`~powerlens._src.reproduce.workers`), wait for it and read them back;
        whatever it did not finish is computed here."""
        worker = self.pending.pop(model, None)
        if worker is not None:
            try:
                self.store.adopt(worker.result())
            except Exception as exc:  # noqa: BLE001  (a dead worker: its model is computed here instead)
                print(f"powerlens reproduce: the worker process for {model} failed ({type(exc).__name__}: {exc}); "
                      f"computing its chunks here", file=sys.stderr)
        return self.store.cached(key, compute)

    def fig(self, name: str) -> str:
        """Absolute path for a figure; sections list it relative to ``out``."""
        os.makedirs(os.path.join(self.out, "figures"), exist_ok=True)
        return io.claim(self.out, "figures/" + name)      # listed as powerlens's before it is written

    def rel(self, path: str) -> str:
        return os.path.relpath(path, self.out)

    def progress(self, iterable, desc: str):
        """``iterable`` with progress on stderr: a tqdm bar on a terminal, one line per item
        elsewhere ("powerlens reproduce: 7 steering 2/3: smollm2"), nothing when not
        ``show_progress`` (``--quiet``)."""
        items = list(iterable)
        if self.show_progress and not stderr_is_tty():
            return _lines(items, desc)
        from tqdm.auto import tqdm
        return tqdm(items, desc=desc, disable=not self.show_progress, leave=True)


def stderr_is_tty() -> bool:
    """Whether stderr is a terminal (a tqdm bar), else one line per item."""
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def _lines(items: list, desc: str):
    for i, item in enumerate(items, 1):
        print(f"powerlens reproduce: {desc} {i}/{len(items)}: {item}", file=sys.stderr, flush=True)
        yield item


def all_sections() -> List[Callable]:
    """Sections 1-8 in the order of the report."""
    from . import real_models, steering_section, synthetic
    layer_varying, shared_real, ffn = real_models.SECTIONS
    return list(synthetic.SECTIONS) + [layer_varying, shared_real] + steering_section.SECTIONS + [ffn]
