"""Steering as values (issue 44 item 2): ``pl.optimize_steering(model, x0, objective, *, edit=,
optimizer=, config=)`` with ``AlignmentObjective`` / ``TokenObjective`` and ``SteeringConfig``.

- The objectives check their fields at construction, each with a one-line error naming the field.
- The new form equals the old keyword form bitwise (the default optimiser is the old Adam on a
  cosine decay); the old form still works and warns (DeprecationWarning).
- Any optax transformation drives the loop: ``optax.sgd`` gives another edit than Adam, and
  ``lagrangian.default_optimizer(lr, steps)`` passed explicitly gives the default's numbers.
- The edit parametrisations live in ``steering/edits.py``; ``token.py`` no longer imports
  ``optimize`` (no optimize <-> token cycle, no private names across modules).
"""
from __future__ import annotations

import ast
import os
import sys
import warnings

import numpy as np
import optax
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_steer_token import D, tiny_decoder  # noqa: E402

import powerlens as pl  # noqa: E402
from powerlens._src.steering.lagrangian import default_optimizer  # noqa: E402

X0 = np.random.default_rng(0).normal(size=(2, 3, D)).astype(np.float32)
U = np.random.default_rng(1).normal(size=(2, D))


@pytest.mark.parametrize("make, match", [
    (lambda: pl.AlignmentObjective(U, target=1.5), "AlignmentObjective.target"),
    (lambda: pl.AlignmentObjective(U, reduce="median"), "AlignmentObjective.reduce"),
    (lambda: pl.AlignmentObjective(U, signed="yes"), "AlignmentObjective.signed"),
    (lambda: pl.AlignmentObjective(np.zeros((2, 2, 2))), "AlignmentObjective.direction"),
    (lambda: pl.AlignmentObjective("north"), "AlignmentObjective.direction"),
    (lambda: pl.TokenObjective([1.5]), "TokenObjective.token_ids"),
    (lambda: pl.TokenObjective([], 0.5), "TokenObjective.token_ids"),
    (lambda: pl.TokenObjective([1, 2], target_prob=1.0), "TokenObjective.target_prob"),
    (lambda: pl.TokenObjective([1, 2], target_prob=[0.1, 0.2, 0.3]), "TokenObjective.target_prob"),
    (lambda: pl.TokenObjective([1], max_kl=-1.0), "TokenObjective.max_kl"),
    (lambda: pl.TokenObjective([1], max_kl=float("nan")), "TokenObjective.max_kl"),
])
def test_objectives_check_their_fields(make, match):
    with pytest.raises(ValueError, match=match) as err:
        make()
    assert "\n" not in str(err.value)


def test_config_and_edit_are_checked():
    model = tiny_decoder(1, vocab=5)
    goal = pl.AlignmentObjective(U, target=0.9)
    with pytest.raises(ValueError, match="unknown edit"):
        pl.optimize_steering(model.layers, X0, goal, edit="dense")
    with pytest.raises(TypeError, match="SteeringConfig"):
        pl.optimize_steering(model.layers, X0, goal, config={"steps": 3})
    with pytest.raises(TypeError, match="GradientTransformation"):
        pl.optimize_steering(model.layers, X0, goal, optimizer="adam")
    with pytest.raises(TypeError, match="target"):
        pl.optimize_steering(model.layers, X0, goal, target=0.5)


@pytest.mark.parametrize("config, match", [
    (lambda: pl.SteeringConfig(dynamics="paper"), "SteeringConfig.dynamics must be a powerlens.Dynamics"),
    (lambda: pl.SteeringConfig(dynamics=pl.Dynamics(attention_block=4)), "SteeringConfig.dynamics.attention_block"),
])
def test_steering_config_checks_its_dynamics(config, match):
    with pytest.raises(ValueError, match=match) as err:
        config()
    assert "\n" not in str(err.value)


def test_the_token_objective_refuses_other_dynamics():
    model = tiny_decoder(1, vocab=5)
    cfg = pl.SteeringConfig(steps=2, dynamics=pl.Dynamics.faithful())
    with pytest.raises(ValueError, match="token objective runs the model's own forward"):
        pl.optimize_steering(model, X0, pl.TokenObjective([0]), config=cfg)


def test_config_dynamics_is_the_run_that_is_steered():
    """SteeringConfig(dynamics=...) steers that run: the same numbers as the deprecated keywords
    rule=/attention=/keep_bias=, ``faithful`` resolved to the model's rule (pre_ln for this
    pre-norm decoder), and another rule gives another edit."""
    layers = tiny_decoder(1, vocab=5).layers
    goal = pl.AlignmentObjective(U, target=0.9)
    fields = ("factor_P", "factor_Q", "norm", "alignment", "history_norm")
    got = {}
    for dyn in (pl.Dynamics(rule="pre_ln", attention="uniform", keep_bias=False), pl.Dynamics.faithful()):
        got[dyn] = pl.optimize_steering(layers, X0, goal, config=pl.SteeringConfig(steps=6, dynamics=dyn))
        with pytest.warns(DeprecationWarning):
            old = pl.optimize_steering(layers, X0, U, target=0.9, steps=6, rule="pre_ln", attention=dyn.attention,
                                       keep_bias=dyn.keep_bias)
        _same(got[dyn], old, fields)
        assert got[dyn].rule == "pre_ln"
    paper = pl.optimize_steering(layers, X0, goal, config=pl.SteeringConfig(steps=6))
    assert paper.rule == "paper" and not np.array_equal(paper.history_norm, got[pl.Dynamics.faithful()].history_norm)


def _same(a, b, fields):
    for f in fields:
        assert np.array_equal(getattr(a, f), getattr(b, f), equal_nan=True), f


def test_alignment_values_equal_the_keyword_form_and_take_any_optax():
    layers = tiny_decoder(1, vocab=5).layers
    cfg = pl.SteeringConfig(steps=12, rank=1, seed=3)
    new = pl.optimize_steering(layers, X0, pl.AlignmentObjective(U, target=0.9, reduce="min"), config=cfg)
    with pytest.warns(DeprecationWarning, match="AlignmentObjective"):
        old = pl.optimize_steering(layers, X0, U, target=0.9, reduce="min", steps=12, seed=3)
    fields = ("factor_P", "factor_Q", "norm", "alignment", "multiplier", "history_alignment", "history_norm")
    _same(new, old, fields)
    explicit = pl.optimize_steering(layers, X0, pl.AlignmentObjective(U, target=0.9, reduce="min"), config=cfg,
                                    optimizer=default_optimizer(1e-2, 12))
    _same(new, explicit, fields)
    sgd = pl.optimize_steering(layers, X0, pl.AlignmentObjective(U, target=0.9, reduce="min"), config=cfg,
                               optimizer=optax.sgd(1e-3))
    assert not np.array_equal(sgd.history_norm, new.history_norm)
    assert sgd.history_norm.shape == new.history_norm.shape == (2, 12)


def test_token_values_equal_the_keyword_form_and_take_any_optax():
    model = tiny_decoder(1, vocab=5)
    goal = pl.TokenObjective([0, 0], target_prob=[0.3, 0.9], max_kl=5.0, controls=[[1, 2], [3]])
    cfg = pl.SteeringConfig(steps=10)
    fields = ("factor_P", "factor_Q", "norm", "target_prob", "control_kl", "shrink", "history_norm")
    for edit in ("lowrank", "activation"):
        new = pl.optimize_steering(model, X0, goal, edit=edit, config=cfg)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            old = pl.optimize_steering(model, X0, [0, 0], objective="token", param=edit, target_prob=[0.3, 0.9],
                                       max_kl=5.0, controls=[[1, 2], [3]], steps=10)
        assert any(issubclass(w.category, DeprecationWarning) for w in caught)
        _same(new, old, fields)
    sgd = pl.optimize_steering(model, X0, goal, edit="lowrank", config=cfg, optimizer=optax.sgd(1e-2))
    assert not np.array_equal(sgd.history_norm, new.history_norm)


def test_edits_module_breaks_the_cycle():
    import powerlens._src.steering.token as T
    tree = ast.parse(open(T.__file__).read())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "optimize" not in imported and "edits" in imported
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not any(name.startswith("_") and name != "__future__" for name in names - {"annotations"})
    from powerlens._src.steering import edits
    assert set(edits.EDITS) == {"lowrank", "w_alpha", "activation"}


def test_the_compiled_loops_take_one_static_value():
    """solve_one, solve_token_one, their phases and token_adam take everything static as one
    hashable settings value (their only keyword-only parameter besides a phase's length n)."""
    import dataclasses
    import inspect
    import powerlens._src.steering.optimize as O
    import powerlens._src.steering.token as T
    for fn in (O.solve_one, O.solve_many, O.solve_many_sharded, O.align_start, O.align_advance, O.align_finish,
               T.solve_token_one, T.token_start, T.token_advance, T.token_finish, T.token_adam):
        kwonly = {n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY}
        assert kwonly <= {"settings", "n"} and "settings" in kwonly, (fn.__name__, kwonly)
        assert not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values()), fn.__name__
    a = O.AlignSettings(layer=0, tail=(0,), rule="paper", attention="softmax", keep_bias=False, target=0.9,
                        reduce="min", param="lowrank", rank=1, steps=3, lr=1e-2, mu=100.0, dual_every=10, tol=1e-4,
                        w_kind="value")
    t = T.TokenSettings(layer=0, tail=(0,), n_prompts=1, param="lowrank", max_kl=0.5, steps=3, lr=3e-3, mu=10.0,
                        dual_every=10, tol=0.0)
    for s in (a, t):
        assert hash(s) == hash(dataclasses.replace(s)) and s == dataclasses.replace(s)
        assert s != dataclasses.replace(s, steps=4)
