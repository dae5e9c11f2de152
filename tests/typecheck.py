"""Run-time checking of the public functions' annotations for the test session.

Every public function of ``powerlens._EXPORTS`` (not its classes, modules or constants) is wrapped
with ``jaxtyping.jaxtyped(typechecker=beartype.beartype)``: its jaxtyping array annotations
(``Float[ArrayLike, "B n d"]``: dtype, rank and shape names bound across the arguments and the
result of one call) and its other annotations are checked on every call. ``powerlens.<name>``,
the attribute of the module ``_EXPORTS`` names and that of the function's defining module are
replaced by the checked function (so ``pl.run`` and ``powerlens._src.dynamics.run.run`` are checked;
a reference another module imported before the patch is not).

tests/conftest.py calls :func:`install` once, unless ``POWERLENS_TYPECHECK=0``.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
import warnings
from typing import Callable, Dict

ENV = "POWERLENS_TYPECHECK"
CHECKED = "__powerlens_typechecked__"
"""The attribute a checked function carries (its value: the unchecked function)."""


def enabled(environ) -> bool:
    """Checking is on unless the environment says ``POWERLENS_TYPECHECK=0``."""
    return environ.get(ENV, "1").strip() != "0"


def public_functions() -> Dict[str, Callable]:
    """``{name: function}`` of every public name of ``powerlens._EXPORTS`` that is a plain
    Python function (classes, modules and constants are left out)."""
    import powerlens as pl
    out = {}
    for name, (module, attr) in pl._EXPORTS.items():
        if attr is None:
            continue
        value = getattr(importlib.import_module(module), attr)
        value = getattr(value, CHECKED, value)
        if inspect.isfunction(value):
            out[name] = value
    return out


def checked(fn: Callable) -> Callable:
    """``fn`` wrapped with ``jaxtyped(typechecker=beartype)`` (once: a checked function is
    returned as is).

    Two things keep the wrapper invisible to what the suite tests besides the annotations:

    * the code's own one-line errors come first: when the arguments violate an annotation,
      ``fn`` itself is called; an error raised by powerlens' own code (a ValueError naming the
      option, say) is raised, chained to the ``TypeCheckError``; else (``fn`` accepts the call,
      or fails inside a library) the jaxtyping/beartype ``TypeCheckError``;
    * a warning the call raises at a wrapper frame (a ``stacklevel`` counted for the plain
      function, like the deprecation warnings of the loose keywords) is re-raised at the
      caller of the checked function, where the plain function puts it.
    """
    if getattr(fn, CHECKED, None) is not None:
        return fn
    import beartype
    import jaxtyping
    from beartype.roar import BeartypeDecorHintPep585DeprecationWarning
    with warnings.catch_warnings():     # typing.Sequence & co: deprecated, still exact
        warnings.simplefilter("ignore", BeartypeDecorHintPep585DeprecationWarning)
        # the PEP 484 numeric tower: an int is a float, a float or int a complex (as type checkers read it)
        inner = jaxtyping.jaxtyped(typechecker=beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True)))(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        caller, caught = sys._getframe(1), []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                warnings.simplefilter("ignore", BeartypeDecorHintPep585DeprecationWarning)
                try:
                    return inner(*args, **kwargs)
                except jaxtyping.TypeCheckError as err:
                    if "checking the parameters" not in str(err):
                        raise
                    try:
                        fn(*args, **kwargs)
                    except Exception as own:
                        if _own_error(own):      # its own validation refuses the call
                            raise
                    raise err
        finally:
            _rewarn(caught, caller)

    setattr(call, CHECKED, fn)
    return call


def _own_error(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by powerlens' own code (its validation), not inside a library
    it calls (a JAX broadcasting error on a mask of the wrong length, say)."""
    import powerlens
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(os.path.dirname(powerlens.__file__) + os.sep)


def _wrapper_frame(filename: str) -> bool:
    return (filename.startswith("<@beartype") or filename == __file__
            or any(f"{os.sep}{lib}{os.sep}" in filename for lib in ("jaxtyping", "beartype")))


def _rewarn(caught, caller) -> None:
    """Raise the recorded warnings again, under the filters outside, those that point at a
    wrapper frame at ``caller`` instead."""
    for w in caught:
        if _wrapper_frame(w.filename):
            where = (caller.f_code.co_filename, caller.f_lineno, caller.f_globals.get("__name__"),
                     caller.f_globals.setdefault("__warningregistry__", {}))
        else:
            where = (w.filename, w.lineno, None, None)
        warnings.warn_explicit(w.message, w.category, *where[:2], module=where[2], registry=where[3])


def install() -> Dict[str, Callable]:
    """Replace every public function by its checked form on ``powerlens``, on the module
    ``_EXPORTS`` names and on the function's defining module; returns ``{name: checked}``."""
    import powerlens as pl
    done: Dict[int, Callable] = {}          # id(function) -> checked (``align`` is ``align_model``)
    out = {}
    for name, fn in public_functions().items():
        module, attr = pl._EXPORTS[name]
        wrapped = done.setdefault(id(fn), checked(fn))
        for mod in {sys.modules[module], sys.modules[fn.__module__]}:
            if getattr(mod, attr, None) is fn:
                setattr(mod, attr, wrapped)
            if getattr(mod, fn.__name__, None) is fn:
                setattr(mod, fn.__name__, wrapped)
        setattr(pl, name, wrapped)
        out[name] = wrapped
    return out
