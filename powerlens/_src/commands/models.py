"""``powerlens spectrum MODEL`` and ``powerlens align MODEL``."""
from __future__ import annotations

import dataclasses
import os
import threading
from typing import Callable, List

from .. import io
from ..analysis.alignment import AlignResult, align_model, model_spectra, spectra_by_layer, whole_stack_fits
from ..analysis.spectra import LAYER_FIELDS, ORDERS, host_layer_matrices, layer_spectra, spectra_json
from ..dynamics.options import Dynamics
from ..dynamics.params import check_steps
from . import budget
from .simulate import settings_of


def read_prompts_file(path: str) -> List[str]:
    """The non-blank lines of a UTF-8 prompts file, stripped; errors name the file and the line."""
    if not os.path.isfile(path):
        raise ValueError(f"--prompts file {path!r} does not exist")
    with open(path, "rb") as fh:
        raw = fh.read()
    texts = []
    for i, line in enumerate(raw.splitlines(), 1):
        try:
            text = line.decode("utf-8-sig" if i == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"--prompts file {path!r}: line {i} is not valid UTF-8 (byte {exc.start + 1} of the "
                             f"line is {line[exc.start:exc.start + 1]!r}); save the file as UTF-8") from None
        if text.strip():
            texts.append(text.strip())
    if not texts:
        raise ValueError(f"--prompts file {path!r} is empty (no line with text); write one prompt per line")
    return texts


def read_prompts(args) -> List[str]:
    """Prompts from repeated ``--text`` and/or a ``--prompts`` file (one per line, blanks skipped)."""
    texts = list(args.text or [])
    if getattr(args, "prompts", None):
        texts += read_prompts_file(args.prompts)
    if not texts:
        raise ValueError("no prompts: give --text \"...\" (repeatable) or --prompts FILE")
    for i, t in enumerate(texts):
        if not t.strip():
            raise ValueError(f"prompt {i} is empty")
    return texts


def layers_json(model, spectra) -> list:
    """spectrum.json's ``layers`` list, with the ALBERT group index where there is one."""
    out = spectra_json(spectra)
    info = model.info
    if info is not None and info.family == "albert":
        for entry in out:
            entry["group"] = entry["layer"] // max(info.inner_group_num, 1)
    return out


def dtypes_json(model) -> dict:
    """What the model's weights are held in, what its steps compute in and at which matmul precision."""
    layers = model.layers
    return {"storage_dtype": str(layers.storage_dtype), "compute_dtype": str(layers.dtype),
            "precision": layers.config.precision}


def load_options(args) -> dict:
    """``pl.load``'s keywords from a command's options: ``--allow-download``, ``--dtype`` (None:
    the checkpoint's own) and ``--precision`` (default ``highest``); compute stays float32."""
    return {"allow_download": getattr(args, "allow_download", False), "dtype": getattr(args, "dtype", None),
            "precision": getattr(args, "precision", None) or "highest"}


class Done:
    """A value already computed, with :class:`InBackground`'s ``result()``."""

    def __init__(self, value):
        self._value = value

    def result(self):
        return self._value


class InBackground:
    """``fn(*args, **kwargs)`` started in a daemon thread at once; :meth:`result` waits for it and
    returns its value, or raises its exception. For NumPy work that spends its time in LAPACK,
    which releases the GIL, so that it runs beside the caller's Python on another core. ``fn``
    must not call JAX: a daemon thread is stopped where it stands when the process exits (an
    error or an interrupt in the caller exits at once), which NumPy survives and XLA does not."""

    def __init__(self, fn: Callable, *args, **kwargs):
        self._outcome: dict = {}
        self._thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable, args, kwargs) -> None:
        try:
            self._outcome["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001  (raised again in the caller's thread by result())
            self._outcome["error"] = exc

    def result(self):
        self._thread.join()
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["value"]


def cmd_spectrum_model(args) -> int:
    from ..analysis import plots
    from ..models import load
    # F_t = W_o V_cat needs each layer's W_v and W_o alone: nothing else is read
    model = load(args.model, parts="spectrum", **load_options(args))
    # the whole stack of F_t at once, or (a large model) one layer's F and eig workspace at a time
    at_once = model.layers.n_unique if whole_stack_fits(model.layers) else 1
    budget.check(budget.spectra_estimate(at_once, model.layers.config.d_model))
    spectra = model_spectra(model, progress=not args.quiet)
    doc = {"settings": {**settings_of(args), "versions": io.versions()},
           "model": {"family": model.info.family, "source": model.info.source,
                     "unique_layers": model.layers.n_unique, "schedule": list(model.layers.schedule),
                     **dtypes_json(model)},
           "layer_fields": LAYER_FIELDS, "layers": layers_json(model, spectra)}
    with io.output_dir(args.out, command=args.command) as stage:
        io.write_json(os.path.join(stage, "spectrum.json"), doc)
        plots.plot_eigenvalues(spectra, os.path.join(stage, "eigenvalues.png"),
                               title=f"{args.model}: eigenvalues of F_t = O_t V_t")
    differ = [s.layer for s in spectra if s.orderings_differ]
    print(f"wrote {args.out}: spectrum.json, eigenvalues.png ({len(spectra)} layers; orderings differ at {differ})")
    return 0


def cmd_align(args, figures=None) -> int:
    """``powerlens align``; ``figures``: the :class:`~powerlens._src.runtime.figures.FigureProcess`
    that draws (default: this process)."""
    if figures is None:
        from ..runtime.figures import FigureProcess
        figures = FigureProcess(None)
    from ..models import embed, load
    texts = read_prompts(args)
    if (args.shared_layer is None) != (args.steps is None):
        raise ValueError("--shared-layer and --steps go together")
    if args.steps is not None:
        check_steps(args.steps)
    # align's rules (paper, post_ln, pre_ln) never read the FFN or the LM head
    model = load(args.model, parts="attention", **load_options(args))
    layers = model.layers
    if whole_stack_fits(layers):
        budget.check(budget.spectra_estimate(layers.n_unique, layers.config.d_model))
        # the spectra (spectra_of, split where JAX ends) are computed on another core while this
        # thread embeds the prompts and imports the figure's modules: LAPACK releases the GIL
        F, factors = host_layer_matrices(layers)
        spectra = InBackground(layer_spectra, F, factors=factors)
    else:                                     # a large model: one layer's F at a time
        budget.check(budget.spectra_estimate(1, layers.config.d_model))
        spectra = Done(spectra_by_layer(layers, progress=not args.quiet))
    x0, valid = embed(model, texts)
    steps = len(layers.schedule) if args.steps is None else args.steps
    budget.check(budget.run_estimate(**budget.shapes_of(layers), steps=steps, batch=x0.shape[0], tokens=x0.shape[1],
                                     orders=len(ORDERS)))
    if figures.pid is None:             # drawn here: imported now, beside the spectra's thread
        from ..analysis import plots  # noqa: F401
    versions = io.versions()
    result = align_model(model, texts, dynamics=Dynamics(rule=args.rule), shared_layer=args.shared_layer,
                         steps=args.steps, seed=args.seed, progress=not args.quiet, x0=x0, valid=valid,
                         spectra=spectra.result())
    doc = {"settings": {**settings_of(args), "versions": versions}, "model": dtypes_json(model), **result.to_json(),
           "layer_fields": LAYER_FIELDS, "layers": layers_json(model, result.spectra)}
    with io.output_dir(args.out, command=args.command) as stage:
        # drawn by the figure process (the spectra, tens of MB, are not needed to draw)
        figures.draw(AlignResult.plot, dataclasses.replace(result, spectra=[]), stage, title=args.model)
        io.write_json(os.path.join(stage, "align.json"), doc)
        figures.wait()
    print(f"wrote {args.out}: align.json, alignment figures ({result.n_tokens} tokens, {len(texts)} prompts)")
    for order in ORDERS:
        s = result.summary(order)
        print(f"  {order:>7}: mean gamma_t={s['mean_gamma']:.3f} (chance {s['mean_chance']:.3f}), "
              f"mean rho_t={s['mean_rho']:.3f}")
    return 0
