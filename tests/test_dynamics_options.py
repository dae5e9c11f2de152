"""``pl.Dynamics``: the run options as one frozen, hashable value.

* It is frozen and hashable (a ``jit`` static argument: equal values share one compiled
  program), validates every field by name, and resolves ``faithful`` against a config.
* ``dynamics=D`` gives bitwise the numbers of the old loose-keyword call, on every entry point
  that took them; the loose keywords still work, with a ``DeprecationWarning`` naming the
  equivalent value, and each entry point keeps its old default (``run_states``/``trace``:
  the model's own forward pass, ``Dynamics.full()``).
* powerlens's own code never passes the deprecated keywords: the CLI, ``align``, ``trace``,
  ``hidden_states``, the sweeps and the steering paths run with that warning as an error.
"""
from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import powerlens as pl
from powerlens._src.dynamics.options import RULE_CHOICES, Dynamics, as_dynamics
from powerlens._src.dynamics.params import LayerConfig, make_layers
from powerlens._src.models.base import Model, ModelInfo

D, H, E, F, VOCAB = 6, 2, 3, 5, 7
OURS = r".*deprecated; pass dynamics="          # the shim's warning, and no other


def tiny_decoder(seed: int = 0) -> Model:
    """Two pre-norm causal blocks (LayerNorm, GELU FFN), biases b_v, b_o (so ``keep_bias``
    changes the numbers), no final norm, a tied head of VOCAB rows."""
    rng = np.random.default_rng(seed)
    r = lambda *s: (0.5 * rng.normal(size=(2,) + s)).astype(np.float32)
    cfg = LayerConfig(d_model=D, n_heads=H, n_kv_heads=H, d_head=E, norm="layernorm", norm_placement="pre",
                      causal=True, ffn_activation="gelu")
    layers = make_layers(W_v=r(H, E, D), W_o=r(D, H * E), W_q=r(H, E, D), W_k=r(H, E, D), b_v=r(H, E), b_o=r(D),
                         norm_scale=1 + r(D), norm_bias=r(D), ffn_norm_scale=1 + r(D), ffn_norm_bias=r(D),
                         W_in=r(F, D), W_out=r(D, F), config=cfg)
    word = rng.normal(size=(VOCAB, D)).astype(np.float32)
    return Model(layers=layers, embeddings={"word": word},
                 info=ModelInfo(family="synthetic", source="", decoder=True, pad_token_id=0))


@pytest.fixture(scope="module")
def system():
    layers = pl.synthetic_system([2.0, 0.5 + 1.0j, 0.3], kind="normal", heads=2, d=6, steps=5)
    x0 = pl.sphere_tokens(np.random.default_rng(0), 4, 6)
    return layers, np.asarray(x0, np.float32)


def _same(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------------ the value

def test_frozen_hashable_and_one_default():
    d = Dynamics()
    assert (d.rule, d.attention, d.keep_bias) == ("paper", "softmax", None) and d == Dynamics.paper()
    assert hash(Dynamics("full")) == hash(Dynamics.full()) and len({Dynamics(), Dynamics.paper(), Dynamics.full()}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.rule = "full"
    assert dataclasses.replace(d, rule="post_ln") == Dynamics(rule="post_ln")
    # keep_bias None: the rule's own choice, c dropped by paper alone
    assert not d.keeps_bias and Dynamics.full().keeps_bias and Dynamics.faithful().keeps_bias
    assert Dynamics("paper", keep_bias=True).keeps_bias and not Dynamics("full", keep_bias=False).keeps_bias
    assert Dynamics(keep_bias=np.bool_(True)).keep_bias is True          # a NumPy bool becomes a bool


@pytest.mark.parametrize("field, value, allowed", [
    ("rule", "ffn", RULE_CHOICES), ("rule", None, RULE_CHOICES), ("attention", "linear", pl.ATTENTION_MODES)])
def test_a_bad_field_is_named_with_its_choices(field, value, allowed):
    with pytest.raises(ValueError) as exc:
        Dynamics(**{field: value})
    msg = str(exc.value)
    assert f"Dynamics.{field}" in msg and repr(value) in msg and all(a in msg for a in allowed)
    assert "\n" not in msg


@pytest.mark.parametrize("value", [1, 0, "yes"])
def test_keep_bias_is_a_bool_or_none(value):
    with pytest.raises(ValueError, match=r"Dynamics\.keep_bias: must be True, False or None"):
        Dynamics(keep_bias=value)


def test_faithful_resolves_by_norm_placement():
    post = LayerConfig(d_model=4, n_heads=1, n_kv_heads=1, d_head=4, norm="layernorm", norm_placement="post")
    pre = dataclasses.replace(post, norm_placement="pre")
    assert Dynamics.faithful().resolved(post) == Dynamics("post_ln")
    assert Dynamics.faithful("uniform").resolved(pre) == Dynamics("pre_ln", "uniform")
    assert Dynamics("full").resolved(pre) == Dynamics("full")


def test_a_jit_static_argument(system):
    """Equal values (distinct objects) hit one compiled program; a different value compiles anew."""
    layers, x0 = system
    traced = []

    @jax.jit
    def plain(x):
        return pl.run(layers, x, None, dynamics=Dynamics(), observers={"final": pl.final()})["final"]

    def g(x, dynamics):
        traced.append(dynamics)
        return pl.run(layers, x, None, dynamics=dynamics, observers={"final": pl.final()})["final"]

    f = jax.jit(g, static_argnames="dynamics")
    a = f(x0, dynamics=Dynamics())
    b = f(x0, dynamics=Dynamics(rule="paper", attention="softmax"))
    c = f(x0, dynamics=Dynamics(attention="uniform"))
    assert len(traced) == 2
    _same(a, b)
    _same(a, plain(x0))
    assert not np.allclose(np.asarray(a), np.asarray(c))


# ------------------------------------------------------------------ the shim

def test_shim_rules():
    with pytest.raises(ValueError, match="run: dynamics must be a powerlens.Dynamics"):
        as_dynamics("paper")
    with pytest.raises(ValueError, match="not both"):
        as_dynamics(Dynamics(), rule="paper")
    assert as_dynamics(None) == Dynamics() and as_dynamics(None, default=Dynamics.full()) == Dynamics.full()
    with pytest.warns(DeprecationWarning, match=r"pass dynamics=Dynamics\(rule='full', attention='uniform'"):
        assert as_dynamics(None, "full", "uniform") == Dynamics("full", "uniform")
    with pytest.warns(DeprecationWarning):      # only the rule: keep_bias back to the new rule's default
        assert as_dynamics(None, "paper", default=Dynamics("full", keep_bias=True)) == Dynamics("paper")
    with pytest.warns(DeprecationWarning):      # only attention: the default's rule and bias kept
        assert as_dynamics(None, attention="uniform", default=Dynamics.full()) == Dynamics("full", "uniform")


def _old(fn, *args, **kw):
    """fn called with the deprecated keywords: the warning is raised, pointing at this file."""
    with pytest.warns(DeprecationWarning, match=OURS) as rec:
        out = fn(*args, **kw)
    assert any(w.filename == __file__ for w in rec)
    return out


@pytest.mark.parametrize("rule, attention, keep_bias", [("paper", "softmax", None), ("post_ln", "uniform", True)])
def test_dynamics_equals_the_old_keywords_bitwise(system, rule, attention, keep_bias):
    layers, x0 = system
    dyn = Dynamics(rule, attention, keep_bias)
    old = dict(rule=rule, attention=attention, keep_bias=keep_bias)
    obs = lambda: {"consensus": pl.consensus(), "final": pl.final()}
    _same(pl.run(layers, x0, None, dynamics=dyn, observers=obs()),
          _old(pl.run, layers, x0, None, observers=obs(), **old))
    _same(pl.run_batch(layers, x0[None], dynamics=dyn, observe=("final", "consensus")),
          _old(pl.run_batch, layers, x0[None], observe=("final", "consensus"), **old))
    subs = pl.reference_subspaces(pl.spectra_of(layers))
    _same(pl.simulate(layers, x0, subs, dynamics=dyn), _old(pl.simulate, layers, x0, subs, **old))
    _same(pl.simulate_batch(layers, x0[None], subs, dynamics=dyn),
          _old(pl.simulate_batch, layers, x0[None], subs, **old))
    stacked = pl.stack_systems([layers, layers])
    sub2 = jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), subs)
    _same(pl.simulate_sweep(stacked, np.stack([x0, x0[::-1]]), sub2, dynamics=dyn, shard=False),
          _old(pl.simulate_sweep, stacked, np.stack([x0, x0[::-1]]), sub2, shard=False, **old))
    new = pl.run_system(layers, x0, dynamics=dyn, progress=False)
    _same(new.measures.gamma, _old(pl.run_system, layers, x0, progress=False, **old).measures.gamma)


def test_each_entry_point_keeps_its_default(system):
    """No options: run, run_batch, simulate, run_system run the paper rule; run_states and
    trace the model's own forward pass (rule full, c kept), as before."""
    layers, x0 = system
    obs = {"final": pl.final()}
    _same(pl.run(layers, x0, None, observers=obs), pl.run(layers, x0, None, dynamics=Dynamics.paper(), observers=obs))
    _same(pl.run_batch(layers, x0[None]), pl.run_batch(layers, x0[None], dynamics=Dynamics.paper()))
    model = tiny_decoder()
    ids = [[1, 2, 3, 4], [5, 6, 1]]
    x, valid = pl.embed_ids(model, *_padded(ids))
    states = pl.run_states(model, x, valid)
    _same(states, pl.run_states(model, x, valid, dynamics=Dynamics("full", keep_bias=True)))
    _same(states, _old(pl.run_states, model, x, valid, rule="full"))
    assert not np.allclose(np.asarray(states), np.asarray(pl.run_states(model, x, valid, dynamics=Dynamics(
        "full", keep_bias=False))))                                  # the bias is there, and kept by default
    _same(pl.hidden_states(model, x, valid).states, states)
    tr = pl.trace(model, ids)
    assert tr.rule == "full"
    np.testing.assert_array_equal(np.asarray(tr.states), np.asarray(states))
    for dyn, old in [(Dynamics.paper(), dict(rule="paper")),
                     (Dynamics("full", keep_bias=False), dict(keep_bias=False))]:
        a, b = pl.trace(model, ids, dynamics=dyn), _old(pl.trace, model, ids, **old)
        np.testing.assert_array_equal(np.asarray(a.states), np.asarray(b.states))
        assert a.rule == b.rule == dyn.rule
    with pytest.raises(ValueError, match="trace runs the model's softmax attention"):
        pl.trace(model, ids, dynamics=Dynamics("full", "uniform"))


def _padded(ids):
    from powerlens._src.models.embed import pad_ids
    return pad_ids(ids, 0)


# ------------------------------------------------------------------ powerlens's own code

@pytest.fixture
def ours_is_an_error():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=OURS, category=DeprecationWarning)
        yield


def test_powerlens_never_passes_the_deprecated_keywords(ours_is_an_error, tmp_path, system):
    from powerlens.cli import main
    from powerlens._src.steering.effects import paper_alignment
    assert main(["simulate", "--spectrum", "3,1,0.5", "--dim", "6", "--tokens", "4", "--steps", "6",
                 "--rule", "post_ln", "--keep-bias", "--quiet", "--out", str(tmp_path / "sim")]) == 0
    model = tiny_decoder(3)
    ids = [[1, 2, 3], [4, 5, 6, 1]]
    for dyn in (Dynamics(), Dynamics.faithful()):
        res = pl.align(model, ids, dynamics=dyn)
        assert res.rule == dyn.resolved(model.layers.config).rule
    pl.trace(model, ids, attention_weights=True)
    x, valid = pl.embed_ids(model, *_padded(ids))
    pl.hidden_states(model, x, valid)
    layers, x0 = system
    u = np.eye(6)[0]
    pl.minimal_alpha(model.layers, u, x, valid=valid, target=0.5, w="value", signed=False)
    paper_alignment(layers, x0[None], np.ones((1, 4), bool), u)
    pl.entering_states(model.layers, x, valid, layer=-1, rule="full")
    table = pl.sweep({"name": "t", "seed": 1, "grid": {"beta": [0.5]},
                      "system": {"d": 4, "tokens": 3, "heads": 1, "replicates": 1}, "run": {"steps": 3}},
                     progress=False)
    assert len(table) == 1
