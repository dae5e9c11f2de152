"""One model over 8 devices (``pl.shard``, ``pl.load(mesh=)``), on 8 CPU host devices.

A tiny random Llama with grouped-query attention, 8 query heads over 4 key/value heads, FFN
width 32 and a vocabulary of 64 (untied LM head), is loaded twice in a fresh process with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``: whole, and sharded over a
``model_mesh(model=8)`` (and over ``data=2 x model=4``, prompts split over ``data``).

* Placement, from ``addressable_shards`` (bytes counted per device): every query-head, FFN
  and vocabulary weight holds exactly 1/8 of its bytes on each device; the 4 KV heads do not
  divide by 8 and are replicated, while over ``model=4`` they hold 1/4; norms replicated.
  So each device holds at most 1/8 of the attention and FFN weights plus the replicated
  norms and the replicated KV heads (which the table of ``MODEL_SPLIT`` says).
* Every call equals the unsharded model to 1e-5: ``run_states`` (the model's own pass and
  the paper rule), ``hidden_states``, ``logits``, ``trace`` (states, gamma, next logits),
  ``generate`` (greedy ids, and sampled with one key), ``optimize_steering`` (alignment and
  token objectives) and a ``[model]`` sweep (its table); over ``data=2 x model=4`` (prompts
  split over ``data``) the forward passes, the logits and greedy decoding.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = r"""
import json, sys
import numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, sys.argv[3])
import hf_tiny_decoders as T
import powerlens as pl
from powerlens._src.dynamics import execution
from powerlens._src.dynamics.params import MODEL_SPLIT
folder, out = sys.argv[1], sys.argv[2]
assert jax.device_count() == 8
T.build("llama", folder, seed=3, vocab_size=64, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
        head_dim=8, intermediate_size=32, num_hidden_layers=2, tie_word_embeddings=False, rope_theta=100.0)
from tokenizers import Tokenizer, models, pre_tokenizers                 # a word-level tokenizer: w0 .. w63
tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.save(folder + "/tokenizer.json")

whole = pl.load(folder)
mesh = execution.model_mesh(model=8)
sharded = pl.load(folder, mesh=mesh)
again = pl.shard(whole, mesh)
res = {}

# ---- placement: bytes per device
def per_device(a):
    held = {}
    for s in a.addressable_shards:
        held[s.device.id] = held.get(s.device.id, 0) + s.data.nbytes
    return held

fractions = {}
for name in MODEL_SPLIT:
    a = getattr(sharded.layers, name)
    if a is not None:
        fractions[name] = [v / a.nbytes for v in per_device(a).values()]
        assert len(per_device(a)) == 8
for name, a in (("word", sharded.embeddings["word"]), ("lm_head", sharded.lm_head)):
    fractions[name] = [v / a.nbytes for v in per_device(a).values()]
res["fractions"] = fractions
attn_ffn = ("W_q", "W_k", "W_v", "W_o", "W_in", "W_gate", "W_out")
norms = ("norm_scale", "ffn_norm_scale")
total = sum(getattr(whole.layers, k).nbytes for k in attn_ffn)
held = [sum(per_device(getattr(sharded.layers, k))[d.id] for k in attn_ffn) for d in jax.devices()]
res["held"], res["total"] = held, total
res["kv_bytes"] = sum(getattr(whole.layers, k).nbytes for k in ("W_k", "W_v"))
res["norm_bytes"] = [sum(per_device(getattr(sharded.layers, k))[d.id] for k in norms) for d in jax.devices()]
res["norm_total"] = sum(getattr(whole.layers, k).nbytes for k in norms)
res["same_as_shard"] = all(bool(jnp.array_equal(a, b)) and a.sharding == b.sharding
                           for a, b in zip(jax.tree_util.tree_leaves(sharded), jax.tree_util.tree_leaves(again)))
m4 = execution.model_mesh(model=4, data=2)
s4 = pl.shard(whole, m4)
res["kv4"] = [v / s4.layers.W_k.nbytes for v in per_device(s4.layers.W_k).values()]
res["q4"] = [v / s4.layers.W_q.nbytes for v in per_device(s4.layers.W_q).values()]

# ---- every call, whole against sharded
texts = ["w3 w9 w17 w33 w5 w60 w1", "w7 w2 w44 w8"]
ids = [[3, 9, 17, 33, 5, 60, 1], [7, 2, 44, 8]]
err = {}
def cmp(key, a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (key, a.shape, b.shape)
    same = np.isfinite(a) == np.isfinite(b)         # a non-finite value must be so in both
    ok = np.isfinite(a) & same
    scale = max(1.0, float(np.max(np.abs(a[ok]), initial=0.0)))
    err[key] = float(np.max(np.abs(a[ok] - b[ok]), initial=0.0)) / scale if same.all() else float("inf")

for label, m in (("model8", sharded), ("data2_model4", s4)):
    x0, valid = pl.embed(whole, texts)
    xs, vs = pl.embed(m, texts)
    cmp(f"{label} embed", x0, xs)
    if label == "data2_model4":
        xs, vs = pl.shard_prompts(xs, m4), pl.shard_prompts(vs, m4)
        res["prompt_devices"] = len(xs.sharding.device_set)
        res["prompt_split"] = [s.data.shape[0] for s in xs.addressable_shards]
        # the prompts stay split: each device computes its own prompt's states ("[T+1 B n d]")
        res["states_split"] = [s.data.shape[1] for s in pl.run_states(m, xs, vs).addressable_shards]
    cmp(f"{label} run_states", pl.run_states(whole, x0, valid), pl.run_states(m, xs, vs))
    cmp(f"{label} run_states paper", pl.run_states(whole, x0, valid, dynamics=pl.Dynamics()),
        pl.run_states(m, xs, vs, dynamics=pl.Dynamics()))
    hw, hs = pl.hidden_states(whole, x0, valid), pl.hidden_states(m, xs, vs)
    cmp(f"{label} hidden_states", hw.states, hs.states)
    cmp(f"{label} hidden_states normed", hw.normed, hs.normed)
    lw, ls = pl.logits(whole, hw[-1]), pl.logits(m, hs[-1])
    cmp(f"{label} logits", lw, ls)
    res.setdefault("logit_devices", len(ls.sharding.device_set))
    if label != "model8":                          # over data x model: the forward passes and greedy decoding
        gw, gs = pl.generate(whole, ids, max_new_tokens=6), pl.generate(m, ids, max_new_tokens=6)
        assert gw.new_ids == gs.new_ids, (label, gw.new_ids, gs.new_ids)
        continue
    tw, ts = pl.trace(whole, ids), pl.trace(m, ids)
    cmp(f"{label} trace states", tw.states, ts.states)
    cmp(f"{label} trace next_logits", tw.next_logits, ts.next_logits)
    for ref in ("principal", "random"):
        cmp(f"{label} trace gamma {ref}", tw.gamma[ref], ts.gamma[ref])
    gw, gs = pl.generate(whole, ids, max_new_tokens=6), pl.generate(m, ids, max_new_tokens=6)
    assert gw.new_ids == gs.new_ids, (label, gw.new_ids, gs.new_ids)
    key = jax.random.key(7)
    gw = pl.generate(whole, ids, max_new_tokens=6, key=key, temperature=0.7)
    gs = pl.generate(m, ids, max_new_tokens=6, key=key, temperature=0.7)
    assert gw.new_ids == gs.new_ids, (label, gw.new_ids, gs.new_ids)
    u = np.eye(64)[:2]
    aw = pl.optimize_steering(whole, x0, u, valid=valid, target=0.8, steps=20)
    As = pl.optimize_steering(m, xs, u, valid=vs, target=0.8, steps=20)
    cmp(f"{label} steer alignment delta_O", aw.delta_O, As.delta_O)
    cmp(f"{label} steer alignment closed_norm", aw.closed_norm, As.closed_norm)
    cmp(f"{label} steer alignment closed_alignment", aw.closed_alignment, As.closed_alignment)
    tw_ = pl.optimize_steering(whole, x0, [5, 9], objective="token", valid=valid, target_prob=0.3, max_kl=5.0,
                               controls=[[1, 2, 3]], steps=10)
    ts_ = pl.optimize_steering(m, xs, [5, 9], objective="token", valid=vs, target_prob=0.3, max_kl=5.0,
                               controls=[[1, 2, 3]], steps=10)
    cmp(f"{label} steer token delta_O", tw_.delta_O, ts_.delta_O)
    cmp(f"{label} steer token target_prob", tw_.target_prob, ts_.target_prob)

# ---- a [model] sweep on the sharded model (the engine's loaded model replaced by it)
from powerlens._src.sweeps import systems
spec = {"name": "sharded", "grid": {"steps": [3, 5]}, "model": {"name": folder, "layers": [0, 1], "prompts": texts}}
df_whole = pl.sweep(spec, progress=False)
systems._model.cache_clear(); systems._model_inputs.cache_clear(); systems._model_spectrum.cache_clear()
real = systems._model
systems._model = lambda name: sharded
df_sharded = pl.sweep(spec, progress=False)
systems._model = real
for col in ("final_gamma", "lambda1_re", "final_consensus"):
    if col in df_whole:
        cmp(f"sweep {col}", df_whole[col].to_numpy(), df_sharded[col].to_numpy())
res["sweep_rows"] = len(df_sharded)
res["err"] = err
json.dump(res, open(out, "w"))
"""


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    import json
    tmp = tmp_path_factory.mktemp("shard")
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp / "llama"), str(tmp / "out.json"), HERE],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads((tmp / "out.json").read_text())


@pytest.mark.slow                     # a fresh 8-device process: start, load and compile (~2 min CPU)
def test_each_device_holds_an_eighth_of_the_split_weights(result):
    fr = result["fractions"]
    for name in ("W_q", "W_o", "W_in", "W_gate", "W_out", "word", "lm_head"):
        assert fr[name] == [0.125] * 8, (name, fr[name])
    for name in ("W_k", "W_v"):                     # 4 KV heads over 8 devices: replicated
        assert fr[name] == [1.0] * 8, (name, fr[name])
    for frac in (fr["norm_scale"], fr["ffn_norm_scale"]):
        assert frac == [1.0] * 8
    # at most 1/8 of the attention and FFN weights, plus the replicated KV heads
    split_total = result["total"] - result["kv_bytes"]
    assert all(h == split_total / 8 + result["kv_bytes"] for h in result["held"]), result["held"]
    assert all(n == result["norm_total"] for n in result["norm_bytes"])
    # over model = 4 the 4 KV heads divide: a quarter each, as the query heads
    assert result["kv4"] == [0.25] * 8 and result["q4"] == [0.25] * 8
    assert result["same_as_shard"]                  # pl.load(mesh=) is pl.shard of the load


@pytest.mark.slow
def test_every_call_equals_the_unsharded_model(result):
    err = result["err"]
    assert len(err) >= 24, sorted(err)
    bad = {k: v for k, v in err.items() if not v <= 1e-5}
    assert not bad, bad
    assert result["logit_devices"] == 8 and result["sweep_rows"] == 8
    assert result["prompt_devices"] == 8 and result["prompt_split"] == [1] * 8   # 2 prompts over data = 2
    assert result["states_split"] == [1] * 8


def test_one_rule_per_field_and_the_mesh_checks():
    """Every field of Layers has its rule in MODEL_SPLIT (a new field cannot go unplaced); a
    mesh whose data x model is not the device count, or without a ``model`` axis, is refused
    in one line; on one device ``shard`` keeps every value."""
    import dataclasses

    import jax
    import powerlens as pl
    from powerlens._src.dynamics import execution
    from powerlens._src.dynamics.params import MODEL_SPLIT
    from powerlens._src.dynamics.parts import PARTS
    fields = {name for part in PARTS.values() for name in part.names()}     # every array of every part
    assert set(MODEL_SPLIT) == fields
    n = jax.device_count()
    with pytest.raises(ValueError, match=f"data=2 x model={n} must equal the {n} devices"):
        execution.model_mesh(model=n, data=2)
    with pytest.raises(ValueError, match="has no 'model' axis"):
        pl.shard(pl.synthetic_system([1.5], heads=2, d=4), execution.device_mesh(1))
    layers = pl.synthetic_system([1.5, 0.3], heads=2, d=4, steps=3)
    placed = pl.shard(layers, pl.model_mesh())
    for a, b in zip(jax.tree_util.tree_leaves(layers), jax.tree_util.tree_leaves(placed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
