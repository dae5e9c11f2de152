"""Hostile and careless checkpoints and weights files (issue 10, the checkpoint side).

Every bad input is built here, in a temporary folder, from a valid tiny file (BERT and
GPT-2 safetensors folders, a one-block llama GGUF, an ``.npz`` system), then broken in one
way. Each must be one ``CheckpointError`` (a ValueError: the CLI prints it as one line and
exits 2) naming the file and the culprit, and it must come before anything large is
allocated: the memory cases run in a subprocess under ``RLIMIT_AS`` and must fail in
seconds with the clear message, not with MemoryError or the kernel's OOM killer.

The fuzz tests (hypothesis) corrupt a valid safetensors file and a valid GGUF in small
ways: every outcome is a load with finite weights or a ``CheckpointError``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import struct
import subprocess
import sys
import textwrap
import time
import zipfile

import numpy as np
import pytest

from powerlens._src.models import CheckpointError, load
from powerlens._src.models.npz import load_weights_npz

D, H, F, V, P = 4, 2, 8, 11, 8         # width, heads, FFN width, vocabulary, positions
LIMIT_GB = 3                            # RLIMIT_AS of the memory tests
FAST_S = 30                             # "a few seconds" on a busy 2-core machine, with the imports


# ----------------------------------------------------------------------------- valid tiny files
def _rng(seed=0):
    return np.random.default_rng(seed)


def _normal(rng, *shape):
    return (0.5 * rng.standard_normal(shape)).astype(np.float32)


def bert_tensors(n_layers: int, seed: int = 0) -> dict:
    rng = _rng(seed)
    t = {"embeddings.word_embeddings.weight": _normal(rng, V, D),
         "embeddings.position_embeddings.weight": _normal(rng, P, D),
         "embeddings.token_type_embeddings.weight": _normal(rng, 2, D),
         "embeddings.LayerNorm.weight": np.ones(D, np.float32), "embeddings.LayerNorm.bias": np.zeros(D, np.float32)}
    for i in range(n_layers):
        p = f"encoder.layer.{i}."
        for name, (out, inp) in {"attention.self.query": (D, D), "attention.self.key": (D, D),
                                 "attention.self.value": (D, D), "attention.output.dense": (D, D),
                                 "intermediate.dense": (F, D), "output.dense": (D, F)}.items():
            t[p + name + ".weight"] = _normal(rng, out, inp)
            t[p + name + ".bias"] = _normal(rng, out)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            t[p + norm + ".weight"] = np.ones(D, np.float32)
            t[p + norm + ".bias"] = np.zeros(D, np.float32)
    return t


def bert_config(n_layers: int, **over) -> dict:
    cfg = dict(model_type="bert", hidden_size=D, num_attention_heads=H, num_hidden_layers=n_layers,
               intermediate_size=F, vocab_size=V, max_position_embeddings=P, type_vocab_size=2)
    cfg.update(over)
    return cfg


def gpt2_tensors(n_layers: int, seed: int = 0) -> dict:
    rng = _rng(seed)
    t = {"wte.weight": _normal(rng, V, D), "wpe.weight": _normal(rng, P, D),
         "ln_f.weight": np.ones(D, np.float32), "ln_f.bias": np.zeros(D, np.float32)}
    for i in range(n_layers):
        p = f"h.{i}."
        for name, shape in {"attn.c_attn": (D, 3 * D), "attn.c_proj": (D, D), "mlp.c_fc": (D, F),
                            "mlp.c_proj": (F, D)}.items():
            t[p + name + ".weight"] = _normal(rng, *shape)
            t[p + name + ".bias"] = _normal(rng, shape[1])
        for norm in ("ln_1", "ln_2"):
            t[p + norm + ".weight"] = np.ones(D, np.float32)
            t[p + norm + ".bias"] = np.zeros(D, np.float32)
    return t


def gpt2_config(n_layers: int, **over) -> dict:
    cfg = dict(model_type="gpt2", n_embd=D, n_head=H, n_layer=n_layers, n_positions=P, vocab_size=V, n_inner=F)
    cfg.update(over)
    return cfg


def write_folder(folder, tensors: dict, config) -> str:
    from safetensors.numpy import save_file
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(config, fh)
    return str(folder)


# llama GGUF metadata: key -> (value, writer type); a negative value is written as int32
GGUF_META = {"llama.block_count": 1, "llama.context_length": P, "llama.embedding_length": D,
             "llama.feed_forward_length": F, "llama.attention.head_count": H, "llama.attention.head_count_kv": H,
             "llama.attention.layer_norm_rms_epsilon": 1e-6}


def write_gguf(path, *, blocks: int = 1, seed: int = 0, **meta) -> str:
    """A tiny llama GGUF with ``blocks`` blocks of tensors; ``meta`` overrides GGUF_META
    (keys with the ``llama.`` prefix and dots written as ``__``)."""
    import gguf
    rng = _rng(seed)
    values = dict(GGUF_META)
    values.update({"llama." + k.replace("__", "."): v for k, v in meta.items()})
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in values.items():
        if isinstance(value, float):
            w.add_float32(key, value)
        elif value < 0:
            w.add_int32(key, value)
        else:
            w.add_uint32(key, value)
    w.add_tensor("token_embd.weight", _normal(rng, V, D))
    w.add_tensor("output_norm.weight", np.ones(D, np.float32))
    for i in range(blocks):
        b = f"blk.{i}."
        for name, shape in {"attn_q": (D, D), "attn_k": (D, D), "attn_v": (D, D), "attn_output": (D, D),
                            "ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F)}.items():
            w.add_tensor(b + name + ".weight", _normal(rng, *shape))
        w.add_tensor(b + "attn_norm.weight", np.ones(D, np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(D, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def npz_arrays(seed: int = 0) -> dict:
    rng = _rng(seed)
    return {"W_v": _normal(rng, H, 2, D), "W_o": _normal(rng, D, H * 2), "W_q": _normal(rng, H, 2, D),
            "W_k": _normal(rng, H, 2, D)}


def write_npz(path, **over) -> str:
    arrays = npz_arrays()
    arrays.update(over)
    np.savez(str(path), **arrays)
    return str(path)


def npy_header_only(shape, dtype="<f8") -> bytes:
    """The bytes of a .npy file that declares ``shape`` but holds no data."""
    import io
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": tuple(shape)})
    return buf.getvalue()


def write_lying_npz(path, shape) -> str:
    """A valid system whose W_v member declares ``shape`` (and holds nothing)."""
    write_npz(path)
    tmp = str(path) + ".tmp"
    with zipfile.ZipFile(str(path)) as src, zipfile.ZipFile(tmp, "w") as dst:
        for item in src.infolist():
            data = npy_header_only(shape) if item.filename == "W_v.npy" else src.read(item)
            dst.writestr(item.filename, data)
    os.replace(tmp, str(path))
    return str(path)


def one_line_error(fn, *args, **kw) -> str:
    """Call ``fn``; it must raise one CheckpointError whose message is one line. Returns it."""
    with pytest.raises(CheckpointError) as info:
        fn(*args, **kw)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def weights_finite(model) -> bool:
    import jax
    return all(bool(np.isfinite(np.asarray(a)).all()) for a in jax.tree_util.tree_leaves(model)
               if np.issubdtype(np.asarray(a).dtype, np.floating))


# ----------------------------------------------------------------------------- the valid files load
def test_the_valid_tiny_files_load(tmp_path):
    assert load(write_folder(tmp_path / "bert", bert_tensors(2), bert_config(2))).layers.n_unique == 2
    assert load(write_folder(tmp_path / "gpt2", gpt2_tensors(2), gpt2_config(2))).layers.n_unique == 2
    assert load(write_gguf(tmp_path / "tiny.gguf")).layers.n_unique == 1
    assert load_weights_npz(write_npz(tmp_path / "w.npz")).n_unique == 1


# ----------------------------------------------------------------------------- 1. bounded memory
MEMORY_SCRIPT = textwrap.dedent("""
    import json, resource, sys, time
    limit = int(sys.argv[1]) << 30
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from powerlens._src.models import load
    from powerlens._src.models.npz import load_weights_npz
    out = {}
    for case, kind, path in json.loads(sys.argv[2]):
        t0 = time.perf_counter()
        try:
            load_weights_npz(path) if kind == "npz" else load(path)
            result = ("loaded", "")
        except BaseException as exc:      # MemoryError included: the test reports what it was
            result = (type(exc).__name__, str(exc))
        out[case] = result + (time.perf_counter() - t0,)
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def memory_results(tmp_path_factory):
    """Every huge-declaration case, loaded in one subprocess under RLIMIT_AS."""
    root = tmp_path_factory.mktemp("memory")
    cases = [
        ("bert_layers", "folder", write_folder(root / "bert", bert_tensors(1), bert_config(1_000_000_000))),
        ("gpt2_layers", "folder", write_folder(root / "gpt2", gpt2_tensors(1), gpt2_config(1_000_000_000))),
        ("gguf_blocks", "gguf", write_gguf(root / "blocks.gguf", block_count=2 ** 31 - 1)),
        ("gguf_ffn", "gguf", write_gguf(root / "ffn.gguf", feed_forward_length=2 ** 31 - 1)),
        ("npz_huge", "npz", write_lying_npz(root / "huge.npz", (100_000, 100_000, 1000))),
        ("npz_lying", "npz", write_lying_npz(root / "lying.npz", (H, 2, 10_000_000))),
    ]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(LIMIT_GB), json.dumps(cases)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), time.perf_counter() - t0


@pytest.mark.parametrize("case, needles", [
    ("bert_layers", ["config.json", "num_hidden_layers=1000000000", "1 layer", "encoder.layer.N"]),
    ("gpt2_layers", ["config.json", "n_layer=1000000000", "1 layer", "h.N"]),
    ("gguf_blocks", ["blocks.gguf", "llama.block_count=2147483647", "1 layer", "blk.N"]),
    ("gguf_ffn", ["ffn.gguf", "blk.0.ffn_gate.weight", "shape"]),
    ("npz_huge", ["huge.npz", "'W_v'", "(100000, 100000, 1000)", "memory"]),
    ("npz_lying", ["lying.npz", "'W_v'", "(2, 2, 10000000)", "holds"]),
])
def test_huge_declarations_fail_fast_under_a_memory_limit(memory_results, case, needles):
    results, _ = memory_results
    kind, message, seconds = results[case]
    assert kind == "CheckpointError", (kind, message)
    for needle in needles:
        assert needle in message, (needle, message)
    assert "\n" not in message
    assert seconds < FAST_S, seconds


def test_a_config_with_fewer_layers_than_the_tensors_is_an_error(tmp_path):
    msg = one_line_error(load, write_folder(tmp_path / "bert", bert_tensors(3), bert_config(2)))
    assert "config.json" in msg and "num_hidden_layers=2" in msg and "3 layers" in msg
    msg = one_line_error(load, write_folder(tmp_path / "gpt2", gpt2_tensors(3), gpt2_config(1)))
    assert "n_layer=1" in msg and "3 layers" in msg
    msg = one_line_error(load, write_gguf(tmp_path / "few.gguf", blocks=2, block_count=1))
    assert "few.gguf" in msg and "llama.block_count=1" in msg and "2 layers" in msg


def test_a_config_with_more_layers_than_the_tensors_is_an_error(tmp_path):
    msg = one_line_error(load, write_folder(tmp_path / "bert", bert_tensors(2), bert_config(5)))
    assert "num_hidden_layers=5" in msg and "2 layers" in msg


def test_a_huge_albert_schedule_is_refused(tmp_path):
    cfg = bert_config(10 ** 9, model_type="albert", embedding_size=D)
    msg = one_line_error(load, write_folder(tmp_path / "albert", {}, cfg))
    assert "config.json" in msg and "num_hidden_layers=1000000000" in msg


def test_gpt_neo_attention_types_are_counted_not_expanded(tmp_path):
    from powerlens._src.models.gpt_neo import attention_layers
    with pytest.raises(CheckpointError, match=r"attention_types give 2000000000 layer types but num_layers=2"):
        attention_layers({"attention_types": [[["global", "local"], 10 ** 9]]}, 2, "config.json")


def test_a_safetensors_entry_beyond_the_end_of_the_file_is_refused(tmp_path):
    folder = write_folder(tmp_path / "bert", bert_tensors(1), bert_config(1))
    path = os.path.join(folder, "model.safetensors")
    with open(path, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        header, data = json.loads(fh.read(n)), fh.read()
    name = "embeddings.word_embeddings.weight"
    header[name]["shape"] = [10 ** 6, 10 ** 6]
    begin = header[name]["data_offsets"][0]
    header[name]["data_offsets"] = [begin, begin + 4 * 10 ** 12]
    blob = json.dumps(header).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob + data)
    assert "model.safetensors" in one_line_error(load, folder)


# ----------------------------------------------------------------------------- 2. types and values
@pytest.mark.parametrize("key, value, needles", [
    ("W_v", np.ones((H, 2, D), np.complex64), ["'W_v'", "complex"]),
    ("W_o", np.ones((D, H * 2), np.complex128), ["'W_o'", "complex"]),
    ("W_v", np.ones((H, 2, D), bool), ["'W_v'", "bool"]),
    ("W_v", np.full((H, 2, D), "x"), ["'W_v'", "<U1"]),
    ("W_q", np.ones((H, 2, D), np.complex64), ["'W_q'", "complex"]),
    ("scale", np.array(1 + 2j), ["'scale'", "complex"]),
    ("causal", np.array("no"), ["'causal'", "bool"]),
    ("causal", np.array([True, False]), ["'causal'", "shape (2,)"]),
    ("causal", np.array(2), ["'causal'", "2"]),
    ("causal", np.array(0.5), ["'causal'", "float"]),
    ("window", np.array(-3), ["'window'", "-3"]),
    ("window", np.array(2.5), ["'window'", "float"]),
])
def test_npz_types_and_values_are_checked_not_cast(tmp_path, key, value, needles):
    path = write_npz(tmp_path / "w.npz", **{key: value})
    msg = one_line_error(load_weights_npz, path)
    for needle in ["w.npz"] + needles:
        assert needle in msg, (needle, msg)


def test_npz_object_array_names_the_key_and_stays_inert(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "w.npz"
    write_npz(path)
    with zipfile.ZipFile(str(path), "a") as z:     # a pickled object array that would run code
        evil = np.empty((), object)
        evil[()] = _Evil(str(marker))
        import io
        buf = io.BytesIO()
        np.save(buf, evil, allow_pickle=True)
        z.writestr("b_o.npy", buf.getvalue())
    msg = one_line_error(load_weights_npz, str(path))
    assert "'b_o'" in msg and "object" in msg
    assert not marker.exists()


def test_npz_accepts_the_right_types(tmp_path):
    layers = load_weights_npz(write_npz(tmp_path / "w.npz", causal=np.array(1), window=np.array(3, np.int64),
                                        W_v=np.ones((H, 2, D), np.int32)))
    assert layers.config.causal is True
    assert int(np.asarray(layers.window).reshape(-1)[0]) == 3
    layers = load_weights_npz(write_npz(tmp_path / "b.npz", causal=np.array(False)))
    assert layers.config.causal is False


def test_npz_values_beyond_float32_are_not_turned_into_inf(tmp_path):
    path = write_npz(tmp_path / "w.npz", W_v=np.full((H, 2, D), 1e300))
    msg = one_line_error(load_weights_npz, path)
    assert "'W_v'" in msg and "float32" in msg


def test_a_complex_direction_file_names_the_file(tmp_path):
    from powerlens._src.steering.directions import parse_direction
    for name, arr in (("c.npy", np.ones(D, np.complex128)), ("b.npy", np.ones(D, bool))):
        np.save(tmp_path / name, arr)
        with pytest.raises(ValueError, match=rf"direction file .*{name}.*{arr.dtype}"):
            parse_direction(str(tmp_path / name), d=D)


# ----------------------------------------------------------------------------- 3. one-line errors
def test_config_json_that_is_not_an_object(tmp_path):
    for bad in ([1, 2], "bert", 3):
        folder = write_folder(tmp_path / "m", bert_tensors(1), bad)
        msg = one_line_error(load, folder)
        assert "config.json" in msg and "JSON object" in msg


def _write_index(folder, weight_map):
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)


def _sharded(tmp_path):
    folder = write_folder(tmp_path / "m", bert_tensors(1), bert_config(1))
    os.replace(os.path.join(folder, "model.safetensors"), os.path.join(folder, "shard-1.safetensors"))
    return folder


def test_a_shard_index_whose_weight_map_is_a_list(tmp_path):
    folder = _sharded(tmp_path)
    _write_index(folder, ["shard-1.safetensors"])
    msg = one_line_error(load, folder)
    assert "model.safetensors.index.json" in msg and "weight_map" in msg


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/outside.safetensors", "sub/../../x.safetensors",
                                   ""])
def test_a_shard_index_pointing_outside_the_folder_is_refused(tmp_path, shard):
    folder = _sharded(tmp_path)
    with open(tmp_path / "outside.safetensors", "wb") as fh:        # exists: must still be refused
        fh.write(open(os.path.join(folder, "shard-1.safetensors"), "rb").read())
    _write_index(folder, {"embeddings.word_embeddings.weight": shard})
    msg = one_line_error(load, folder)
    assert "model.safetensors.index.json" in msg and repr(shard) in msg and "outside" in msg


def test_a_shard_index_with_a_subfolder_is_accepted(tmp_path):
    folder = _sharded(tmp_path)
    os.makedirs(os.path.join(folder, "sub"))
    os.replace(os.path.join(folder, "shard-1.safetensors"), os.path.join(folder, "sub", "shard-1.safetensors"))
    _write_index(folder, {"embeddings.word_embeddings.weight": "sub/shard-1.safetensors"})
    assert load(folder).layers.n_unique == 1


def test_zero_heads_name_the_key(tmp_path):
    msg = one_line_error(load, write_folder(tmp_path / "g", gpt2_tensors(1), gpt2_config(1, n_head=0)))
    assert "config.json" in msg and "n_head=0" in msg
    msg = one_line_error(load, write_gguf(tmp_path / "h.gguf", attention__head_count=0))
    assert "h.gguf" in msg and "llama.attention.head_count=0" in msg
    msg = one_line_error(load, write_gguf(tmp_path / "kv.gguf", attention__head_count_kv=0))
    assert "kv.gguf" in msg and "llama.attention.head_count_kv=0" in msg


def test_a_negative_gguf_block_count_names_the_file_and_the_key(tmp_path):
    msg = one_line_error(load, write_gguf(tmp_path / "neg.gguf", block_count=-1))
    assert "neg.gguf" in msg and "llama.block_count=-1" in msg


def test_a_gguf_array_longer_than_the_file_is_refused_at_once(tmp_path):
    """The gguf package's reader loops once per declared item of an array of scalars, past the
    end of the file too (the original code hung here, growing without bound)."""
    import gguf
    path = str(tmp_path / "array.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("llama.some_array", [True, False, True])      # 1-byte items: the stock reader never errs
    for key, value in GGUF_META.items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with open(path, "rb") as fh:
        blob = fh.read()
    offset, size = gguf_parts(path)["llama.some_array"][4]    # key length, key, type, item type, length
    with open(path, "wb") as fh:
        fh.write(overwrite(blob, offset, size, 2 ** 40))
    t0 = time.perf_counter()
    msg = one_line_error(load, path)
    assert "array.gguf" in msg and "past the end" in msg
    assert time.perf_counter() - t0 < 5


class _Evil:
    """Unpickling this would create ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def write_evil_bin(folder, marker, *, with_torch: bool) -> str:
    """A BERT folder whose pytorch_model.bin would create ``marker`` if it were unpickled
    (a plain pickle, or torch.save's zip format)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(bert_config(1), fh)
    state = {"embeddings.word_embeddings.weight": _Evil(str(marker))}
    path = os.path.join(folder, "pytorch_model.bin")
    if with_torch:
        import torch
        torch.save(state, path)
    else:
        with open(path, "wb") as fh:
            pickle.dump(state, fh)
    return str(folder)


@pytest.mark.parametrize("with_torch", [False, True])
def test_an_unsafe_pickle_is_one_line_and_inert(tmp_path, with_torch, capsys):
    pytest.importorskip("torch")
    marker = tmp_path / "ran"
    msg = one_line_error(load, write_evil_bin(tmp_path / "m", marker, with_torch=with_torch))
    assert "pytorch_model.bin" in msg and "refused" in msg
    assert len(msg.replace(str(tmp_path), "")) < 400, msg        # one short line, whatever the path
    assert not marker.exists()
    assert capsys.readouterr().err == ""          # no multi-line warning from torch either


def test_a_model_without_a_tokenizer_says_what_to_do(tmp_path):
    from powerlens._src.models.embed import embed
    model = load(write_folder(tmp_path / "m", bert_tensors(1), bert_config(1)))
    msg = one_line_error(embed, model, ["needs a tokenizer"])
    assert "has no tokenizer" in msg and "token ids" in msg and "tokenizer files" in msg


def test_the_download_hint_names_the_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    msg = one_line_error(load, "nobody/no-such-model")
    assert "--allow-download" in msg and "'nobody/no-such-model'" in msg


CLI_CASES = {
    "config_list": lambda p: write_folder(p / "m", bert_tensors(1), [1, 2]),
    "layers_1e9": lambda p: write_folder(p / "m", bert_tensors(1), bert_config(10 ** 9)),
    "n_head_0": lambda p: write_folder(p / "m", gpt2_tensors(1), gpt2_config(1, n_head=0)),
    "gguf_block_count_-1": lambda p: write_gguf(p / "m.gguf", block_count=-1),
    "unsafe_pickle": lambda p: write_evil_bin(p / "m", p / "ran", with_torch=False),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_the_cli_prints_one_line_and_exits_2(tmp_path, capsys, case):
    from powerlens.cli import main
    model = CLI_CASES[case](tmp_path)
    out = tmp_path / "out"
    if case == "unsafe_pickle":
        pytest.importorskip("torch")
    assert main(["spectrum", model, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error:" in err, err
    assert not out.exists()


def test_the_cli_npz_cases_print_one_line_and_exit_2(tmp_path, capsys):
    from powerlens.cli import main
    for key, value in (("W_v", np.ones((H, 2, D), np.complex64)), ("causal", np.array("no")),
                       ("window", np.array(-3))):
        path = write_npz(tmp_path / f"{key}.npz", **{key: value})
        out = tmp_path / "out"
        assert main(["spectrum", "--weights", path, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and repr(key) in err, err
        assert not out.exists()


# ----------------------------------------------------------------------------- 4. fuzz
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

# POWERLENS_FUZZ_EXAMPLES=5000 explores further (with a random seed); the default is a fixed, quick run
_EXPLORE = int(os.environ.get("POWERLENS_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=_EXPLORE or 80, deadline=None, derandomize=not _EXPLORE, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])
INTERESTING = [0, 1, 2, 3, 7, 8, 255, 2 ** 16, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 63 - 1, 2 ** 64 - 1]


def _outcome(path) -> str:
    """'ok' for a load with finite weights, 'error' for a CheckpointError; anything else fails.
    (``--hypothesis-show-statistics`` shows how often each happened.)"""
    from hypothesis import event
    try:
        model = load(path)
    except CheckpointError as exc:
        assert "\n" not in str(exc), str(exc)
        event("CheckpointError")
        return "error"
    assert weights_finite(model)
    event("loaded")
    return "ok"


@dataclasses.dataclass
class Valid:
    """A valid file to corrupt (short repr: hypothesis prints it with a failing example)."""

    path: str                                           # where each corrupted copy is written
    blob: bytes = dataclasses.field(repr=False)         # the valid file
    header_end: int                                     # the corruptions favour the bytes before this
    parts: list = dataclasses.field(repr=False, default_factory=list)   # GGUF: (offset, size) of each field


@pytest.fixture(scope="module")
def valid_safetensors(tmp_path_factory):
    folder = write_folder(tmp_path_factory.mktemp("st_valid"), gpt2_tensors(1), gpt2_config(1))
    with open(os.path.join(folder, "model.safetensors"), "rb") as fh:
        blob = fh.read()
    return Valid(folder, blob, 8 + struct.unpack("<Q", blob[:8])[0])


def _st_json_edit(blob: bytes, n: int, data) -> bytes:
    header = json.loads(blob[8:8 + n])
    name = data.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
    field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "entry"]))
    ints = st.one_of(st.sampled_from(INTERESTING + [-1, -(2 ** 63)]), st.integers(-10, 10 ** 4))
    if field == "dtype":
        header[name]["dtype"] = data.draw(st.sampled_from(
            ["F32", "F16", "BF16", "F64", "I32", "I64", "U8", "BOOL", "C64", "F8_E4M3", "f32", "", 7, None]))
    elif field == "shape":
        header[name]["shape"] = data.draw(st.one_of(st.lists(ints, max_size=4), st.sampled_from(["4", None, 3])))
    elif field == "data_offsets":
        header[name]["data_offsets"] = data.draw(st.one_of(st.lists(ints, min_size=0, max_size=3),
                                                           st.sampled_from(["0", None])))
    else:
        header[name] = data.draw(st.sampled_from([None, [], "x", 1, {}]))
    body = json.dumps(header).encode()
    if data.draw(st.booleans()):                       # keep the declared length, or not
        return struct.pack("<Q", len(body)) + body + blob[8 + n:]
    return blob[:8] + body + blob[8 + n:]


def _corrupt(blob: bytes, header_end: int, data) -> bytes:
    """One small byte-level corruption: a flip (mostly in the header), a truncation, or a
    little-endian integer written over the bytes at some offset."""
    kind = data.draw(st.sampled_from(["flip", "truncate", "int"]))
    if kind == "truncate":
        return blob[:data.draw(st.integers(0, len(blob) - 1))]
    where = data.draw(st.one_of(st.integers(0, header_end - 1), st.integers(0, len(blob) - 1)))
    b = bytearray(blob)
    if kind == "flip":
        b[where] ^= data.draw(st.integers(1, 255))
        return bytes(b)
    size = data.draw(st.sampled_from([4, 8]))
    value = data.draw(st.sampled_from(INTERESTING)) % (1 << (8 * size))
    b[where:where + size] = value.to_bytes(size, "little")[:len(b) - where]
    return bytes(b[:len(blob)])


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors(valid_safetensors, data):
    folder, blob, n = valid_safetensors.path, valid_safetensors.blob, valid_safetensors.header_end - 8
    if data.draw(st.booleans()):
        bad = _st_json_edit(blob, n, data)
    elif data.draw(st.booleans()):
        bad = struct.pack("<Q", data.draw(st.sampled_from(INTERESTING + [n - 1, n + 1, n + 8]))) + blob[8:]
    else:
        bad = _corrupt(blob, 8 + n, data)
    with open(os.path.join(folder, "model.safetensors"), "wb") as fh:
        fh.write(bad)
    _outcome(folder)


def gguf_parts(path: str):
    """{field name: [(offset, size) of each part]} of a GGUF file (metadata and tensor infos)."""
    import gguf
    reader = gguf.GGUFReader(path)
    fields = list(reader.fields.values()) + [t.field for t in reader.tensors]
    return {f.name: [(int(p.ctypes.data - reader.data.ctypes.data), int(p.nbytes)) for p in f.parts]
            for f in fields}


def overwrite(blob: bytes, offset: int, size: int, value: int) -> bytes:
    b = bytearray(blob)
    b[offset:offset + size] = (value % (1 << (8 * size))).to_bytes(size, "little")
    return bytes(b)


@pytest.fixture(scope="module")
def valid_gguf(tmp_path_factory):
    path = write_gguf(tmp_path_factory.mktemp("gguf_valid") / "valid.gguf")
    with open(path, "rb") as fh:
        blob = fh.read()
    parts = sorted({p for ps in gguf_parts(path).values() for p in ps if p[1] in (1, 2, 4, 8)})   # the integers
    return Valid(str(tmp_path_factory.mktemp("gguf_fuzz") / "fuzz.gguf"), blob, max(o + s for o, s in parts), parts)


@FUZZ
@given(data=st.data())
def test_fuzz_gguf(valid_gguf, data):
    path, blob, parts, header_end = valid_gguf.path, valid_gguf.blob, valid_gguf.parts, valid_gguf.header_end
    if data.draw(st.booleans()):                       # a metadata / tensor-info integer edited
        offset, size = data.draw(st.sampled_from(parts))
        bad = overwrite(blob, offset, size, data.draw(st.one_of(st.sampled_from(INTERESTING), st.integers(0, 64))))
    else:
        bad = _corrupt(blob, header_end, data)
    with open(path, "wb") as fh:
        fh.write(bad)
    _outcome(path)
