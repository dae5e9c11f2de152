"""Weights in their own dtype, read only when used (issue: models at the sizes researchers study).

A tiny Llama checkpoint in bf16 sharded safetensors (benchmarks/scale.py's writer, the same
one the 8B benchmark uses):

* its FFN tensors corrupted (a header shape that does not match their bytes, and NaN bytes):
  ``spectrum`` and paper-rule ``align`` still run, so they never read the FFN, while a full
  load names the corrupt tensor;
* bf16 in, bf16 held: the loaded arrays take exactly the checkpoint's bf16 bytes (counted);
* compute in float32 equals a float32 model built from the same bf16 values.
"""
from __future__ import annotations

import json
import os
import struct
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import powerlens as pl
from powerlens.cli import main
from powerlens._src.models.reader import CheckpointError, TensorReader

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import scale  # noqa: E402

CFG = dict(scale.TINY, num_hidden_layers=3)
FFN = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PROMPT = "w1 w5 w9 w2 w7 w3"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("bf16") / "llama")
    # small shards: the index and several files are exercised
    return scale.write_checkpoint(folder, CFG, seed=3, shard_bytes=40_000, progress=False)


def corrupt_ffn(src: str, dst: str) -> str:
    """A copy of ``src`` whose FFN tensors have a wrong header shape and NaN bytes."""
    os.makedirs(dst)
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if not name.endswith(".safetensors"):
            if os.path.isfile(path):
                with open(path, "rb") as fh, open(os.path.join(dst, name), "wb") as out:
                    out.write(fh.read())
            continue
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
            data = bytearray(fh.read())
        for key, meta in header.items():
            if any(f in key for f in FFN):
                a, b = meta["data_offsets"]
                data[a:b] = b"\xff" * (b - a)               # NaN in bf16
                meta["shape"] = [3, 5]                        # not its byte count
        raw = json.dumps(header).encode()
        with open(os.path.join(dst, name), "wb") as out:
            out.write(struct.pack("<Q", len(raw)) + raw + bytes(data))
    return dst


@pytest.fixture(scope="module")
def broken(ckpt, tmp_path_factory):
    return corrupt_ffn(ckpt, str(tmp_path_factory.mktemp("broken") / "llama"))


def test_spectrum_and_paper_align_never_read_the_ffn(broken, tmp_path, capsys):
    with pytest.raises(CheckpointError, match="mlp"):
        pl.load(broken)                                        # a full load does read it, and says so
    assert main(["spectrum", broken, "--out", str(tmp_path / "s")]) == 0
    doc = json.loads((tmp_path / "s" / "spectrum.json").read_text())
    assert doc["model"]["storage_dtype"] == "bfloat16"
    assert doc["model"]["compute_dtype"] == "float32" and doc["model"]["precision"] == "highest"
    assert len(doc["layers"]) == CFG["num_hidden_layers"]
    assert main(["align", broken, "--text", PROMPT, "--rule", "paper", "--quiet", "--out", str(tmp_path / "a")]) == 0
    doc = json.loads((tmp_path / "a" / "align.json").read_text())
    assert doc["model"] == {"storage_dtype": "bfloat16", "compute_dtype": "float32", "precision": "highest"}
    assert doc["rule"] == "paper"
    m = pl.load(broken, parts="attention")
    assert m.layers.W_in is None and m.layers.W_gate is None and m.lm_head is None


def test_spectrum_of_the_broken_checkpoint_is_the_intact_ones(ckpt, broken):
    """The same F_t from the intact and the corrupted file, and the same as numpy's float64
    eig of O V formed from the raw bf16 bytes (an independent reading)."""
    from powerlens._src.commands.models import spectra_by_layer
    a = spectra_by_layer(pl.load(ckpt, parts="spectrum").layers)
    b = spectra_by_layer(pl.load(broken, parts="spectrum").layers)
    H, G, e = CFG["num_attention_heads"], CFG["num_key_value_heads"], CFG["hidden_size"] // CFG["num_attention_heads"]
    for u, (x, y) in enumerate(zip(a, b)):
        np.testing.assert_array_equal(x.shifted.eigenvalues, y.shifted.eigenvalues)
        O = scale.raw_bf16(ckpt, f"model.layers.{u}.self_attn.o_proj.weight")
        V = scale.raw_bf16(ckpt, f"model.layers.{u}.self_attn.v_proj.weight").reshape(G, e, -1)
        w = np.linalg.eigvals(O @ np.repeat(V, H // G, axis=0).reshape(H * e, -1))
        ref = w[np.argmax(np.abs(1 + w))]
        assert abs(x.shifted.top - complex(ref.real, np.sign(x.shifted.top.imag or 1) * abs(ref.imag))) \
            < 1e-5 * abs(ref)


def array_bytes(tree) -> int:
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(tree))


def test_bf16_in_bf16_held_byte_for_byte(ckpt):
    m = pl.load(ckpt)
    r = TensorReader(ckpt, dtype=None)
    file_bytes = sum(r.nbytes(n) for n in r.names())
    weights = [m.embeddings, m.final_norm_scale, m.lm_head,
               m.layers.replace(scale=None, window=None, rope_base=None)]
    for leaf in jax.tree_util.tree_leaves(weights):
        assert leaf.dtype == jnp.bfloat16, leaf.dtype
    assert array_bytes(weights) == file_bytes                    # not twice that (float32)
    assert m.layers.scale.dtype == jnp.float32                   # 1/sqrt(e), not rounded to bf16
    assert m.layers.dtype == jnp.float32 and m.layers.config.precision == "highest"
    f32 = pl.load(ckpt, dtype="float32")
    assert array_bytes(f32.layers.replace(scale=None, window=None)) == 2 * array_bytes(
        m.layers.replace(scale=None, window=None))
    # only what a part needs: spectrum holds W_v and W_o alone
    s = pl.load(ckpt, parts="spectrum")
    L, d, G, H, e = 3, CFG["hidden_size"], CFG["num_key_value_heads"], CFG["num_attention_heads"], 16
    assert array_bytes(s.layers.replace(scale=None, window=None)) == 2 * L * (G * e * d + d * H * e)
    assert s.embeddings == {} and s.lm_head is None and s.layers.W_q is None


def test_float32_compute_equals_a_float32_model_of_the_same_values(ckpt):
    m = pl.load(ckpt)                                 # bf16 held, float32 compute
    f = pl.load(ckpt, dtype="float32")                # float32 held: the same values, exactly
    np.testing.assert_array_equal(np.asarray(m.layers.W_q, np.float32), np.asarray(f.layers.W_q))
    ids = [[1, 5, 9, 2, 7, 3, 11]]
    x_m, v = pl.embed(m, ids)
    x_f, _ = pl.embed(f, ids)
    for rule in ("full", "paper", "pre_ln"):
        a = pl.run_states(m, x_m, v, rule=rule)
        b = pl.run_states(f, x_f, v, rule=rule)
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * float(np.abs(b).max()))
    la = np.asarray(pl.logits(m, pl.hidden_states(m, x_m, v)))
    lb = np.asarray(pl.logits(f, pl.hidden_states(f, x_f, v)))
    assert la.dtype == np.float32
    np.testing.assert_allclose(la, lb, rtol=0, atol=1e-5 * np.abs(lb).max())
    ga = np.asarray(pl.generate(m, ids, max_new_tokens=4).new_ids)
    gb = np.asarray(pl.generate(f, ids, max_new_tokens=4).new_ids)
    np.testing.assert_array_equal(ga, gb)


def test_storage_and_compute_dtype_are_the_users_choice(ckpt):
    m = pl.load(ckpt, compute_dtype=None)             # compute in the stored bf16
    assert m.layers.dtype == jnp.bfloat16 and m.layers.config.compute_dtype is None
    h = pl.load(ckpt, dtype="float16", precision="high")
    assert h.layers.W_o.dtype == jnp.float16 and h.layers.config.precision == "high"
    with pytest.raises(ValueError, match="precision"):
        pl.load(ckpt, precision="tf32-please")
    with pytest.raises(ValueError, match="dtype"):
        pl.load(ckpt, dtype="int8")
    with pytest.raises(ValueError, match="parts"):
        pl.load(ckpt, parts="ffn")


def test_rows_reads_single_rows_of_the_unembedding(ckpt):
    r = TensorReader(ckpt, dtype=None)
    rows = [5, 0, 511, 5]
    got = r.rows("lm_head.weight", rows)
    assert got.dtype == jnp.bfloat16 and got.shape == (4, CFG["hidden_size"])
    np.testing.assert_array_equal(np.asarray(got, np.float64), scale.raw_bf16(ckpt, "lm_head.weight")[rows])
    with pytest.raises(ValueError, match="out of range"):
        r.rows("lm_head.weight", [512])


def test_a_model_that_cannot_fit_is_refused_before_any_tensor_is_read(ckpt, monkeypatch):
    """The refusal comes from the config's sizes and the headers, before a tensor is read."""
    from powerlens._src.models import reader
    monkeypatch.setattr(reader, "available_memory", lambda: 10_000)
    read = []
    monkeypatch.setattr(reader.TensorReader, "get", lambda self, name, *a, **k: read.append(name))
    for parts in ("all", "attention"):
        with pytest.raises(CheckpointError, match=r"the model's weights \(3 layers, word embeddings.*needs") as err:
            pl.load(ckpt, parts=parts)
        assert "\n" not in str(err.value) and f"parts='{parts}'" in str(err.value)
    assert read == []


def test_gguf_dequantised_to_bf16_on_request():
    """SmolLM2 (Q4_1): float32 by default (unchanged), bfloat16 when asked: the same values rounded."""
    try:
        a = pl.load("smollm2", parts="spectrum")
        b = pl.load("smollm2", parts="spectrum", dtype="bfloat16")
    except CheckpointError as exc:                     # pragma: no cover - package not installed
        pytest.skip(str(exc))
    assert a.layers.W_v.dtype == jnp.float32 and b.layers.W_v.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(b.layers.W_o),
                                  np.asarray(a.layers.W_o).astype(jnp.bfloat16))
    assert b.layers.W_q is None and b.lm_head is None and b.embeddings == {}


def test_token_directions_read_single_rows_of_an_unread_head(ckpt, monkeypatch):
    from powerlens._src.models.layout import unembedding_matrix, vocabulary_rows
    m = pl.load(ckpt, parts="attention")
    assert m.lm_head is None and m.info.unread_head == "lm_head.weight" and m.info.parts == "attention"
    assert vocabulary_rows(m) == CFG["vocab_size"]
    got = []
    real = TensorReader.rows
    monkeypatch.setattr(TensorReader, "get", lambda *a, **k: pytest.fail("the whole head was read"))
    monkeypatch.setattr(TensorReader, "rows", lambda self, name, rows, **k: got.append(list(rows)) or
                        real(self, name, rows, **k))
    np.testing.assert_array_equal(unembedding_matrix(m, rows=[3, 7]), scale.raw_bf16(ckpt, "lm_head.weight")[[3, 7]])
    assert got == [[3, 7]]
    with pytest.raises(ValueError, match="without its LM head"):
        pl.logits(m, np.ones((1, CFG["hidden_size"]), np.float32))
    with pytest.raises(ValueError, match="parts='all'"):
        x, v = pl.embed(m, [[1, 2, 3]])
        pl.run_states(m, x, v, rule="full")


def test_each_step_upcasts_its_own_layer_only(ckpt):
    """The compiled run of a bf16 model holds one layer in float32, not the stack: XLA would
    otherwise hoist the cast out of the scan (a float32 copy of every layer). Counted from the
    compiled program's temporary buffers, 8 layers so that one layer is an eighth of the stack."""
    import importlib
    run = importlib.import_module("powerlens._src.dynamics.run")
    folder = os.path.join(os.path.dirname(ckpt), "eight")
    scale.write_checkpoint(folder, dict(CFG, num_hidden_layers=8, hidden_size=128, intermediate_size=16), seed=4,
                           progress=False)
    L = pl.load(folder, parts="attention").layers
    x0 = np.asarray(pl.embed(pl.load(folder, parts="attention"), [[1, 2, 3, 4]])[0], np.float32)
    compiled = run._run_batch.lower(L, x0, np.ones((1, 4), bool), None, None, None, dynamics=pl.Dynamics(),
                                    observe=("final",)).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    stack_f32 = 2 * array_bytes([L.W_q, L.W_k, L.W_v, L.W_o])
    assert temp < stack_f32 / 4, (temp, stack_f32)
