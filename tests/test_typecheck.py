"""The public functions' jaxtyping annotations, checked under beartype in the test session
(tests/typecheck.py, installed by tests/conftest.py unless POWERLENS_TYPECHECK=0)."""
from __future__ import annotations

import inspect
import os
import typing

import jaxtyping
import numpy as np
import pytest

import powerlens as pl
import typecheck

ON = typecheck.enabled(os.environ)
needs_on = pytest.mark.skipif(not ON, reason="POWERLENS_TYPECHECK=0: the public functions are not wrapped")


def _system(d=4):
    return pl.synthetic_system([1.5, 0.5, 0.2, 0.1][:d], kind="symmetric", d=d, steps=3)


def test_enabled_reads_the_environment():
    assert typecheck.enabled({}) and typecheck.enabled({"POWERLENS_TYPECHECK": "1"})
    assert not typecheck.enabled({"POWERLENS_TYPECHECK": "0"})


def test_public_functions_are_the_plain_functions_of_exports():
    fns = typecheck.public_functions()
    assert "run" in fns and "simulate_batch" in fns and "align" in fns
    # classes, modules and constants are left alone
    for name in ("Layers", "Dynamics", "plots", "RULES", "Trajectory"):
        assert name not in fns
    assert all(inspect.isfunction(f) for f in fns.values())


def test_type_hints_resolve_on_every_public_function():
    """No string annotation that is not a type expression is left ("float[n d]" raised)."""
    for name, fn in typecheck.public_functions().items():
        typing.get_type_hints(fn)             # raises NameError / SyntaxError on a bad hint
    hints = typing.get_type_hints(typecheck.public_functions()["run"])
    assert "n d" in str(hints["x0"]) and "Real" in str(hints["x0"])


@needs_on
def test_every_public_function_is_checked_on_pl_and_its_modules():
    import sys
    for name, fn in typecheck.public_functions().items():
        checked = getattr(pl, name)
        assert getattr(checked, typecheck.CHECKED) is fn, name
        assert getattr(sys.modules[fn.__module__], fn.__name__) is checked, name
    assert sys.modules["powerlens._src.dynamics.run"].run is pl.run and pl.align is pl.align_model


@needs_on
def test_run_refuses_tokens_of_the_wrong_rank_naming_the_argument():
    """The annotation check fires (the TypeCheckError names x0); the code's own one-line error,
    which the suite tests elsewhere, is the one raised, chained to it."""
    layers = _system()
    x0 = np.ones((5,), np.float32)              # (n,) instead of (n, d)
    with pytest.raises(ValueError, match=r"x0 of shape \(n, 4\)") as caught:
        pl.run(layers, x0, None, observers={"final": pl.final()})
    assert isinstance(caught.value.__context__, jaxtyping.TypeCheckError)
    assert "parameter 'x0'" in str(caught.value.__context__)


@needs_on
def test_a_call_the_code_accepts_but_the_annotation_refuses_raises_the_check():
    """A list of lists is an array to the code (np.asarray) but not ArrayLike: the check wins."""
    layers = _system()
    x0 = pl.sphere_tokens(np.random.default_rng(0), 5, 4).tolist()
    with pytest.raises(jaxtyping.TypeCheckError, match="x0"):
        pl.run(layers, x0, None, observers={"final": pl.final()})


@needs_on
def test_run_refuses_a_mask_of_another_length_naming_the_argument():
    layers = _system()
    x0 = pl.sphere_tokens(np.random.default_rng(0), 5, 4)
    with pytest.raises(ValueError, match="valid") as caught:
        pl.run(layers, x0, np.ones(4, bool), observers={"final": pl.final()})   # n = 5 tokens, 4 flags
    assert "parameter 'valid'" in str(caught.value.__context__)


@needs_on
def test_deprecation_warnings_still_point_at_the_caller():
    """as_dynamics warns at stacklevel 3, counted for the plain function: the wrapper re-raises
    it at this file, as the plain function does."""
    layers = _system()
    x0 = pl.sphere_tokens(np.random.default_rng(0), 5, 4)
    with pytest.warns(DeprecationWarning, match="deprecated") as rec:
        pl.run(layers, x0, None, observers={"final": pl.final()}, rule="paper")
    assert [w.filename for w in rec if issubclass(w.category, DeprecationWarning)] == [__file__]


@needs_on
def test_mismatched_d_between_arguments_is_refused():
    """attention_output binds n and d across X and the mask; layer_step the same n."""
    layers = _system()
    X = pl.sphere_tokens(np.random.default_rng(0), 5, 4)
    lp = layers.layer(0)
    with pytest.raises(jaxtyping.TypeCheckError, match="valid"):
        pl.layer_step(lp, X, np.ones(3, bool))
    with pytest.raises(jaxtyping.TypeCheckError, match="positions"):
        pl.attention_output(lp, X, np.ones(5, bool), positions=np.arange(7))


@needs_on
def test_right_calls_pass_and_return_the_annotated_shapes():
    layers = _system()
    x0 = pl.sphere_tokens(np.random.default_rng(0), 5, 4)
    out = pl.run(layers, x0, np.ones(5, bool), observers={"final": pl.final()})
    assert out["final"].shape == (5, 4)
    batch = pl.run_batch(layers, np.stack([x0, x0]), np.array([[1, 1, 1, 1, 0]] * 2))   # 0/1 masks are accepted
    assert batch["final"].shape == (2, 5, 4)
    assert pl.layer_step(layers.layer(0), x0, np.ones(5, bool)).shape == (5, 4)
    rates = pl.fit_rates(np.array([[1.0, 0.5, 0.25, 0.125]]), (1e-8, 2.0))
    np.testing.assert_allclose(rates, [0.5], rtol=1e-9)        # exp(slope of log 2^-t) = 1/2


@needs_on
def test_a_result_of_the_wrong_shape_is_refused():
    """The result is checked too (the wrapper fit_rates gets: "float[S]" for S rows of values)."""
    wrapped = typecheck.checked(_rowsum)
    assert wrapped(np.ones((3, 2))).shape == (3,)
    with pytest.raises(jaxtyping.TypeCheckError, match="return"):
        typecheck.checked(_rowsum_keepdims)(np.ones((3, 2)))


def _rowsum(values: jaxtyping.Real[jaxtyping.ArrayLike, "S L"]) -> jaxtyping.Float[np.ndarray, "S"]:
    return np.asarray(values, float).sum(axis=1)


def _rowsum_keepdims(values: jaxtyping.Real[jaxtyping.ArrayLike, "S L"]) -> jaxtyping.Float[np.ndarray, "S"]:
    return np.asarray(values, float).sum(axis=1, keepdims=True)


def _half(x: float) -> float:
    return x / 2


def test_an_int_is_a_float_as_pep_484_reads_it():
    """beartype under the PEP 484 numeric tower: ``target: float`` takes ``1``, not ``"1"``."""
    half = typecheck.checked(_half)
    assert half(1) == 0.5 and half(np.float64(3.0)) == 1.5
    with pytest.raises(jaxtyping.TypeCheckError, match="x"):
        half("1")
