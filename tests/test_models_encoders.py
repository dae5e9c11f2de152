"""BERT, RoBERTa, DistilBERT and ALBERT converters against transformers + torch (oracle only).

Every tiny model has random weights (biases and LayerNorms included), odd head counts
and padded batches; we compare at valid positions only:
  * every entry of Hugging Face's ``hidden_states`` (hs[0] = the embedding output) with
    ``hidden_states(model, *embed_ids(model, ids, mask))``: max abs error <= 1e-4;
  * the attention sub-layer of every unique layer (rule ``post_ln``) with the torch
    attention submodule (+ residual + LayerNorm) on the same input: <= 1e-4;
  * ``layer_matrices`` with W_o @ W_v taken straight from the torch modules (transposes).
Then the bad-input list of issue 3, each with the error naming the fault.
"""
from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_tiny  # noqa: E402
import zero_pad as Z  # noqa: E402
from powerlens._src.dynamics.layer import layer_step  # noqa: E402
from powerlens._src.dynamics.params import layer_matrices  # noqa: E402
from powerlens._src.models import CheckpointError, embed, embed_ids, hidden_states, load  # noqa: E402
from powerlens._src.models.albert import albert_schedule, hidden_state_steps  # noqa: E402

TOL = 1e-4
LENGTHS = [9, 5, 7]      # padded batch: rows 1 and 2 end with padding

CASES = {
    "bert": ("bert", {}),
    "bert_relu_h5": ("bert", dict(hidden_size=40, num_attention_heads=5, num_hidden_layers=3,
                                  hidden_act="relu", type_vocab_size=1, layer_norm_eps=1e-6)),
    "roberta": ("roberta", {}),
    "roberta_h5_gelu_new": ("roberta", dict(hidden_size=40, num_attention_heads=5, num_hidden_layers=3,
                                            hidden_act="gelu_new", max_position_embeddings=64)),
    "distilbert": ("distilbert", {}),
    # the sinusoidal table is stored like a learned one (here re-drawn at random): just read
    "distilbert_relu_sin": ("distilbert", dict(activation="relu", sinusoidal_pos_embds=True, n_layers=3)),
    "albert_g2_i2": ("albert", {}),
    "albert_g1_i1": ("albert", dict(num_hidden_groups=1, inner_group_num=1, hidden_act="gelu")),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """case -> (torch model, folder, powerlens model, ids, mask, HF hidden states)."""
    out = {}
    for case, (family, overrides) in CASES.items():
        folder = tmp_path_factory.mktemp(case)
        tm = hf_tiny.build(family, folder, seed=len(out), **overrides)
        pad = tm.config.pad_token_id
        ids, mask = hf_tiny.random_batch(LENGTHS, seed=len(out), pad_id=pad)
        ref = hf_tiny.torch_hidden_states(tm, ids, mask)
        out[case] = (tm, str(folder), load(str(folder)), ids, mask, ref)
    return out


def _max_err(a, b, mask):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)[..., mask.astype(bool), :]))


@pytest.mark.parametrize("case", list(CASES))
def test_hidden_states_match_transformers(built, case):
    tm, folder, model, ids, mask, ref = built[case]
    x0, valid = embed_ids(model, ids, mask.astype(bool))
    assert _max_err(x0, ref[0], mask) <= TOL          # the embedding output alone
    hs = np.asarray(hidden_states(model, x0, valid))
    assert hs.shape == ref.shape
    errs = [_max_err(hs[k], ref[k], mask) for k in range(len(ref))]
    assert max(errs) <= TOL, errs
    # the comparison is not vacuous: layers change the states by O(1)
    assert np.abs(ref[-1] - ref[0])[mask.astype(bool)].max() > 0.5


def _state_errors(model, tm, ids, mask):
    hs = np.asarray(hidden_states(model, *embed_ids(model, ids, mask.astype(bool))))
    ref = hf_tiny.torch_hidden_states(tm, ids, mask)
    return [_max_err(hs[k], ref[k], mask) for k in range(len(ref))]


@pytest.mark.parametrize("left", [False, True], ids=["right_padded", "left_padded"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_zero_pad_row_is_validated_out_and_inert(built, case, left):
    """The pad token's embedding row zero in both models (as transformers' ``padding_idx``
    leaves it; the positions and the embedding LayerNorm keep x0's padded rows non-zero here):
    the valid tokens' hidden states are transformers' own, right- and left-padded, and every
    valid state of the paper rule with uniform attention is finite."""
    tm, _, model, ids, mask, _ = built[case]
    if left:
        ids, mask = ids[:, ::-1].copy(), mask[:, ::-1].copy()
    Z.check_zero_pad_row(model, tm, ids, mask, _state_errors, TOL, zero_x0=False, pad=tm.config.pad_token_id)


# one prompt -> vmapped over the batch, compiled once per layer config
_post_ln_batch = jax.jit(jax.vmap(
    lambda lp, X, v: layer_step(lp, X, v, rule="post_ln", attention="softmax"), (None, 0, 0)))


def _torch_attention_sublayer(tm, family, u, X, mask):
    """The post-LN attention sub-layer LN(X + Attn(X)) of unique layer u, in torch."""
    am = hf_tiny.additive_mask(mask)
    with torch.no_grad():
        if family in ("bert", "roberta"):
            return tm.encoder.layer[u].attention(X, attention_mask=am)[0]
        if family == "distilbert":
            blk = tm.transformer.layer[u]
            return blk.sa_layer_norm(blk.attention(X, attention_mask=am)[0] + X)
        inner = tm.config.inner_group_num
        mod = tm.encoder.albert_layer_groups[u // inner].albert_layers[u % inner].attention
        return mod(X, attention_mask=am)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_attention_sublayer_post_ln(built, case):
    tm, folder, model, ids, mask, ref = built[case]
    family = CASES[case][0]
    X = ref[1].astype(np.float32)     # a realistic input: the state after the first step
    Xt = torch.as_tensor(X)
    errs = []
    for u in range(model.layers.n_unique):
        want = _torch_attention_sublayer(tm, family, u, Xt, mask).double().numpy()
        got = _post_ln_batch(model.layers.layer(u), X, mask.astype(bool))
        errs.append(_max_err(got, want, mask))
    assert max(errs) <= TOL, errs


def _torch_value_output(tm, family, u):
    """(W_o, W_v) of unique layer u straight from the torch modules."""
    if family in ("bert", "roberta"):
        a = tm.encoder.layer[u].attention
        return a.output.dense.weight, a.self.value.weight
    if family == "distilbert":
        a = tm.transformer.layer[u].attention
        return a.out_lin.weight, a.v_lin.weight
    inner = tm.config.inner_group_num
    a = tm.encoder.albert_layer_groups[u // inner].albert_layers[u % inner].attention
    return a.dense.weight, a.value.weight


@pytest.mark.parametrize("case", list(CASES))
def test_layer_matrices_from_torch_weights(built, case):
    tm, folder, model, ids, mask, ref = built[case]
    F = np.asarray(layer_matrices(model.layers), np.float64)
    for u in range(model.layers.n_unique):
        W_o, W_v = (w.detach().double().numpy() for w in _torch_value_output(tm, CASES[case][0], u))
        want = W_o @ W_v
        np.testing.assert_allclose(F[u], want, atol=1e-5, rtol=1e-5)
        # a transposed reading would differ: the check has teeth
        assert np.abs(want - want.T).max() > 0.1


def test_albert_groups_shared_not_tiled(built):
    tm, folder, model, ids, mask, ref = built["albert_g2_i2"]
    # L=3 outer layers, G=2 groups, I=2 inner: int(i / 1.5) = 0, 0, 1
    assert model.layers.n_unique == 4
    assert model.layers.W_q.shape == (4, 3, 12, 36)
    assert model.layers.schedule == (0, 1, 0, 1, 2, 3)
    assert albert_schedule(3, 2, 2) == (0, 1, 0, 1, 2, 3)
    assert albert_schedule(12, 1, 1) == (0,) * 12
    assert albert_schedule(4, 2, 1) == (0, 0, 1, 1)
    assert hidden_state_steps(3, 2, every_inner=False) == (2, 4, 6)
    assert hidden_state_steps(3, 2, every_inner=True) == (1, 2, 3, 4, 5, 6)
    # the installed transformers' hidden_states count decides the convention
    assert len(ref) == len(model.info.hidden_state_steps) + 1
    assert model.embeddings["project_W"].shape == (36, 20)
    shared = built["albert_g1_i1"][2]
    assert shared.layers.n_unique == 1 and shared.layers.schedule == (0, 0, 0)


def test_family_facts(built):
    rob = built["roberta"][2]
    assert rob.info.family == "roberta" and rob.info.position_offset == 2 and rob.info.pad_token_id == 1
    assert rob.layers.config.norm_eps == 1e-5 and rob.layers.config.ffn_activation == "gelu"
    assert built["bert_relu_h5"][2].layers.config.ffn_activation == "relu"
    assert built["distilbert_relu_sin"][2].layers.config.ffn_activation == "relu"
    assert built["roberta_h5_gelu_new"][2].layers.config.ffn_activation == "gelu_new"
    assert built["albert_g2_i2"][2].layers.config.ffn_activation == "gelu_new"
    dist = built["distilbert"][2]
    assert "token_type" not in dist.embeddings and dist.layers.config.norm_eps == 1e-12
    for case in CASES:
        m = built[case][2]
        assert m.info.tokenizer is None and m.info.max_positions == 64
        assert m.layers.config.norm_placement == "post" and m.layers.config.norm == "layernorm"


def test_roberta_longest_prompt(built):
    """RoBERTa positions start at pad+1 = 2: 62 of the 64 positions are usable."""
    tm, folder, model, ids, mask, ref = built["roberta"]
    long_ids, long_mask = hf_tiny.random_batch([62], seed=5, pad_id=1)
    want = hf_tiny.torch_hidden_states(tm, long_ids, long_mask)[0]
    x0, _ = embed_ids(model, long_ids)
    assert _max_err(x0, want, long_mask) <= TOL
    too_long, _ = hf_tiny.random_batch([63], seed=5, pad_id=1)
    with pytest.raises(ValueError, match="longer than the model's 62 positions"):
        embed_ids(model, too_long)


# ---------------------------------------------------------------------- bad input
@pytest.fixture
def bert_copy(built, tmp_path):
    dst = tmp_path / "bert"
    shutil.copytree(built["bert"][1], dst)
    return dst


def _rewrite(folder, fn):
    from safetensors.numpy import load_file, save_file
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors = fn(tensors) or tensors
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(folder, **changes):
    path = os.path.join(folder, "config.json")
    with open(path) as fh:
        cfg = json.load(fh)
    cfg.update(changes)
    with open(path, "w") as fh:
        json.dump(cfg, fh)


Q0 = "encoder.layer.0.attention.self.query.weight"


def test_missing_config(bert_copy):
    os.remove(bert_copy / "config.json")
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load(str(bert_copy))


def test_missing_weights(bert_copy):
    os.remove(bert_copy / "model.safetensors")
    with pytest.raises(CheckpointError, match="no weights found"):
        load(str(bert_copy))


def test_truncated_safetensors(bert_copy):
    path = bert_copy / "model.safetensors"
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load(str(bert_copy))


def test_corrupt_header(bert_copy):
    with open(bert_copy / "model.safetensors", "r+b") as fh:
        fh.write(b"\xff" * 16)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load(str(bert_copy))


def test_nan_weight(bert_copy):
    def poison(t):
        t[Q0] = t[Q0].copy()
        t[Q0][3, 4] = np.nan
    _rewrite(bert_copy, poison)
    with pytest.raises(CheckpointError, match=r"'encoder\.layer\.0\.attention\.self\.query\.weight' contains non-finite"):
        load(str(bert_copy))


def test_int_weight_rejected(bert_copy):
    def to_int(t):
        t[Q0] = np.zeros(t[Q0].shape, np.int32)
    _rewrite(bert_copy, to_int)
    with pytest.raises(CheckpointError, match=r"query\.weight' has unsupported dtype I32"):
        load(str(bert_copy))


def test_missing_tensor(bert_copy):
    _rewrite(bert_copy, lambda t: {k: v for k, v in t.items() if k != "encoder.layer.1.output.dense.bias"})
    with pytest.raises(CheckpointError, match=r"'encoder\.layer\.1\.output\.dense\.bias' is missing"):
        load(str(bert_copy))


def test_shape_mismatch(bert_copy):
    def reshape(t):
        t[Q0] = np.ones((35, 36), np.float32)
    _rewrite(bert_copy, reshape)
    with pytest.raises(CheckpointError, match=r"query\.weight' has shape \(35, 36\), expected \(36, 36\)"):
        load(str(bert_copy))


@pytest.mark.parametrize("torch_dtype", ["float16", "bfloat16"])
def test_half_checkpoints_upcast(built, tmp_path, torch_dtype):
    """fp16/bf16 weights are held in their own dtype, computed in float32 (not rejected), and
    match the rounded model."""
    ref_model = built["bert"][2]
    tm = hf_tiny.build("bert", tmp_path, seed=0, dtype=getattr(torch, torch_dtype))
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        stored = f.get_slice(f.keys()[0]).get_dtype()
    assert stored == {"float16": "F16", "bfloat16": "BF16"}[torch_dtype]
    model = load(str(tmp_path))
    assert model.layers.W_q.dtype.name == torch_dtype and model.embeddings["word"].dtype.name == torch_dtype
    assert model.layers.dtype == np.float32
    assert load(str(tmp_path), dtype="float32").layers.W_q.dtype == np.float32        # upcast on request
    # exactly the rounded weights, and within half precision of the float32 checkpoint
    want = tm.encoder.layer[1].attention.self.query.weight.detach().numpy().reshape(3, 12, 36)
    np.testing.assert_array_equal(np.asarray(model.layers.W_q[1], np.float32), want)
    rel = {"float16": 2 ** -10, "bfloat16": 2 ** -7}[torch_dtype]
    w32 = np.asarray(ref_model.layers.W_q)
    assert np.all(np.abs(np.asarray(model.layers.W_q, np.float32) - w32) <= rel * np.abs(w32) + 1e-6)
    ids, mask = built["bert"][3], built["bert"][4]
    ref = hf_tiny.torch_hidden_states(tm, ids, mask)
    hs = np.asarray(hidden_states(model, *embed_ids(model, ids, mask.astype(bool))))
    assert max(_max_err(hs[k], ref[k], mask) for k in range(len(ref))) <= TOL


def test_prompt_too_long_and_empty(built):
    model = built["bert"][2]
    with pytest.raises(ValueError, match="prompt of 65 tokens is longer than the model's 64 positions"):
        embed_ids(model, np.ones((1, 65), np.int32))
    embed_ids(model, np.ones((1, 64), np.int32))       # the longest allowed prompt
    with pytest.raises(ValueError, match="empty prompt"):
        embed_ids(model, np.zeros((1, 0), np.int32))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        embed(model, [[5, 6], []])
    with pytest.raises(ValueError, match="out of range"):
        embed_ids(model, np.array([[5, 100]]))
    with pytest.raises(CheckpointError, match="has no tokenizer"):
        embed(model, ["text needs a tokenizer"])


def test_unsupported_model_type(bert_copy):
    _edit_config(bert_copy, model_type="xlnet")
    with pytest.raises(CheckpointError, match="unsupported architecture model_type='xlnet'"):
        load(str(bert_copy))


@pytest.mark.parametrize("changes, message", [
    (dict(position_embedding_type="relative_key"), "position_embedding_type='relative_key' is not supported"),
    (dict(is_decoder=True), "is_decoder=True is not supported"),
    (dict(add_cross_attention=True), "add_cross_attention=True is not supported"),
    (dict(hidden_act="swish"), "unsupported activation hidden_act='swish'"),
    (dict(num_attention_heads=5), "hidden_size=36 is not a multiple of num_attention_heads=5"),
    (dict(hidden_size=None), "required attribute 'hidden_size' is missing"),
])
def test_unhandled_config_attribute(bert_copy, changes, message):
    _edit_config(bert_copy, **changes)
    with pytest.raises(CheckpointError, match=message):
        load(str(bert_copy))


def test_distilbert_and_albert_config_checks(built, tmp_path):
    d = tmp_path / "d"
    shutil.copytree(built["distilbert"][1], d)
    _edit_config(d, activation="tanh")
    with pytest.raises(CheckpointError, match="unsupported activation activation='tanh'"):
        load(str(d))
    a = tmp_path / "a"
    shutil.copytree(built["albert_g2_i2"][1], a)
    _edit_config(a, num_hidden_groups=5)
    with pytest.raises(CheckpointError, match="num_hidden_groups=5 exceeds num_hidden_layers=3"):
        load(str(a))


def test_reader_skips_buffers_by_whole_name(tmp_path):
    """Buffers are skipped by whole dotted components: GPT-2's causal mask ``h.0.attn.bias``
    and ``position_ids`` go, ``h.0.attn.c_attn.bias`` stays; ``out=`` fills a slot in place."""
    from safetensors.numpy import save_file
    from powerlens._src.models.reader import TensorReader
    save_file({"transformer.h.0.attn.bias": np.ones((1, 1, 4, 4), np.float32),
               "transformer.h.0.attn.c_attn.bias": np.arange(6, dtype=np.float32),
               "embeddings.position_ids": np.arange(4, dtype=np.int64),
               "h.0.attn.attention.bias": np.ones((4, 4), np.float32)},
              str(tmp_path / "model.safetensors"))
    r = TensorReader(str(tmp_path))
    assert r.names() == ["h.0.attn.c_attn.bias"]
    stack = np.zeros((2, 6), np.float32)
    r.get("h.0.attn.c_attn.bias", (6,), out=stack[1])
    np.testing.assert_array_equal(stack, [[0] * 6, list(range(6))])
    with pytest.raises(CheckpointError, match=r"'h\.0\.attn\.c_attn\.bias' has shape \(6,\), expected \(2, 3\)"):
        r.get("h.0.attn.c_attn.bias", (2, 3))


@pytest.mark.parametrize("case", ["bert", "distilbert", "albert_g2_i2"])
def test_encoder_converters_load_in_the_dtype_they_are_given(built, case):
    """Each encoder converter honours its ``dtype`` argument, whatever its reader's default:
    given float64 with a float32 reader, every layer array and embedding is float64, holding
    the float32 checkpoint's values (to float32 rounding: the attention scale 1/sqrt(e) is
    computed in the dtype)."""
    from powerlens._src.models.base import CONVERTERS
    from powerlens._src.models.reader import TensorReader, read_config
    folder, ref = built[case][1], built[case][2]
    with jax.enable_x64(True):
        model = CONVERTERS[CASES[case][0]](read_config(folder), TensorReader(folder), np.dtype(np.float64), "")
        floats = lambda m: [a for a in jax.tree_util.tree_leaves((m.layers, m.embeddings))
                            if np.issubdtype(a.dtype, np.floating)]
        got, want = floats(model), floats(ref)
        assert len(got) == len(want) > 10 and {a.dtype for a in got} == {np.dtype(np.float64)}
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b, np.float64), rtol=2 ** -23, atol=0)
