"""``--dtype`` and ``--precision`` of the commands that load a model (spectrum, align, steer).

A tiny Llama checkpoint held in float32 whose values are not bf16 numbers (the 8B benchmark's
writer, then a small float32 offset):

* ``--dtype bfloat16`` holds W_v in bf16: spectrum's lambda_1 is numpy's float64 eig of
  O V formed from the float32 weights rounded to bf16 (an independent reading), within bf16
  rounding of the float32 run's, and not equal to it; the JSON records the dtypes;
* the default keeps the checkpoint's float32; ``--precision`` reaches the layers;
* a bad value is one line naming the option, exit 2, before jax is imported.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import scale  # noqa: E402

CFG = dict(scale.TINY, num_hidden_layers=2, vocab_size=2048)     # the word tokenizer's 2001 ids
PROMPT = "w1 w5 w9 w2 w7 w3"


def bf16_round(a: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bfloat16 (ties to even), as float64."""
    bits = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    r = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint32) << 16
    return r.view(np.float32).astype(np.float64)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A float32 safetensors folder: the bf16 writer's values plus 1e-3 of their size of noise."""
    from safetensors.numpy import save_file
    base = tmp_path_factory.mktemp("dtype")
    src = scale.write_checkpoint(str(base / "bf16"), CFG, seed=5, progress=False)
    dst = base / "f32"
    dst.mkdir()
    rng = np.random.default_rng(0)
    tensors = {}
    for name, _ in scale.tensors_of(CFG):
        a = scale.raw_bf16(src, name)
        tensors[name] = (a * (1 + 1e-3 * rng.standard_normal(a.shape))).astype(np.float32)
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((base / "bf16" / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(dict(cfg, torch_dtype="float32")))
    shutil.copy(base / "bf16" / "tokenizer.json", dst / "tokenizer.json")
    return str(dst), tensors


def lambda1_numpy(tensors, layer: int, *, rounded: bool) -> complex:
    """lambda_1 (shifted order: largest |1 + lambda|) of F = O V_cat in float64 from the tensors."""
    H, G = CFG["num_attention_heads"], CFG["num_key_value_heads"]
    e = CFG["hidden_size"] // H
    f = bf16_round if rounded else (lambda a: np.asarray(a, np.float64))
    O = f(tensors[f"model.layers.{layer}.self_attn.o_proj.weight"])
    V = f(tensors[f"model.layers.{layer}.self_attn.v_proj.weight"]).reshape(G, e, -1)
    w = np.linalg.eigvals(O @ np.repeat(V, H // G, axis=0).reshape(H * e, -1))
    top = w[np.argmax(np.abs(1 + w))]
    return complex(top.real, abs(top.imag))


def test_dtype_option_holds_the_weights_in_it_and_is_recorded(ckpt, tmp_path):
    from powerlens.cli import main
    folder, tensors = ckpt
    assert main(["spectrum", folder, "--out", str(tmp_path / "f32"), "--quiet"]) == 0
    assert main(["spectrum", folder, "--dtype", "bfloat16", "--out", str(tmp_path / "bf16"), "--quiet"]) == 0
    f32 = json.loads((tmp_path / "f32" / "spectrum.json").read_text())
    bf = json.loads((tmp_path / "bf16" / "spectrum.json").read_text())
    assert f32["model"]["storage_dtype"] == "float32"
    assert bf["model"]["storage_dtype"] == "bfloat16" and bf["model"]["compute_dtype"] == "float32"
    assert bf["settings"]["dtype"] == "bfloat16" and bf["model"]["precision"] == "highest"
    for layer in range(CFG["num_hidden_layers"]):
        a = scale.top_of(f32["layers"][layer], "shifted")
        b = scale.top_of(bf["layers"][layer], "shifted")
        ref_f32 = lambda1_numpy(tensors, layer, rounded=False)
        ref_bf = lambda1_numpy(tensors, layer, rounded=True)
        assert abs(a - ref_f32) < 1e-5 * abs(ref_f32)            # the float32 weights as they are
        assert abs(b - ref_bf) < 1e-5 * abs(ref_bf)              # the bf16-rounded weights, exactly those
        assert 0 < abs(a - b) < 3e-2 * abs(a)                    # bf16 rounding apart, not equal


def test_load_options_reach_pl_load(ckpt, tmp_path):
    """The model a command loads: W_v bf16 with --dtype bfloat16, float16 with float16, the
    checkpoint's float32 without; --precision on the layers; align's numbers within bf16 of float32."""
    import argparse

    import jax.numpy as jnp

    import powerlens as pl
    from powerlens.cli import main
    from powerlens._src.commands.models import load_options
    folder, _ = ckpt
    for dtype, want in ((None, jnp.float32), ("bfloat16", jnp.bfloat16), ("float16", jnp.float16)):
        args = argparse.Namespace(dtype=dtype, precision=None)
        m = pl.load(folder, parts="spectrum", **load_options(args))
        assert m.layers.W_v.dtype == want and m.layers.dtype == jnp.float32
        assert m.layers.config.precision == "highest"
    m = pl.load(folder, parts="spectrum", **load_options(argparse.Namespace(dtype=None, precision="high")))
    assert m.layers.config.precision == "high"
    docs = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        assert main(["align", folder, "--text", PROMPT, "--dtype", dtype, "--precision", "high", "--quiet",
                     "--out", str(out)]) == 0
        docs[dtype] = json.loads((out / "align.json").read_text())
        assert docs[dtype]["model"] == {"storage_dtype": dtype, "compute_dtype": "float32", "precision": "high"}
        assert docs[dtype]["settings"]["precision"] == "high"
    gamma = lambda doc: np.asarray([s["gamma"] for s in doc["orders"]["shifted"]["steps"][1:]], np.float64)
    np.testing.assert_allclose(gamma(docs["bfloat16"]), gamma(docs["float32"]), atol=3e-2)


def test_steer_records_the_dtypes(ckpt, tmp_path):
    from powerlens.cli import main
    folder, _ = ckpt
    out = tmp_path / "steer"
    assert main(["steer", folder, "--direction", "random", "--text", PROMPT, "--alpha", "1.0", "--dtype", "bfloat16",
                 "--quiet", "--out", str(out)]) == 0
    doc = json.loads((out / "steer.json").read_text())
    assert doc["model"] == {"storage_dtype": "bfloat16", "compute_dtype": "float32", "precision": "highest"}


SCRIPT = """
import contextlib, io, json, sys
from powerlens.cli import main
err = io.StringIO()
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
    try:
        status = main(sys.argv[1:])
    except SystemExit as exc:
        status = exc.code
print(json.dumps([status, err.getvalue().strip().splitlines(), "jax" in sys.modules]))
"""

BAD = {
    ("spectrum", "MODEL", "--dtype", "int8"): "--dtype must be one of float32, bfloat16, float16, got 'int8'",
    ("align", "MODEL", "--text", "hi", "--dtype", "f32"): "--dtype must be one of float32, bfloat16, float16",
    ("steer", "MODEL", "--direction", "random", "--text", "hi", "--precision", "tf32"):
        "--precision must be one of highest, high, default, got 'tf32'",
    ("spectrum", "--weights", "W.npz", "--dtype", "bfloat16"): "--dtype applies to MODEL, not to --weights",
}


@pytest.mark.parametrize("argv", list(BAD))
def test_bad_values_are_one_line_exit_2_before_jax(ckpt, tmp_path, argv):
    folder, _ = ckpt
    (tmp_path / "W.npz").write_bytes(b"")
    argv = [folder if a == "MODEL" else a for a in argv] + ["--out", "o"]
    r = subprocess.run([sys.executable, "-c", SCRIPT, *argv], capture_output=True, text=True, cwd=tmp_path,
                       timeout=120)
    status, lines, jax_imported = json.loads(r.stdout)
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"powerlens {argv[0]}: error: ") and BAD[tuple(a if a != folder else "MODEL"
                                                                                for a in argv[:-2])] in lines[0]
    assert not jax_imported
    assert not (tmp_path / "o").exists()


def test_cli_choices_are_the_librarys():
    from powerlens.cli import DTYPES, PRECISIONS
    from powerlens._src.dynamics.params import PRECISIONS as LIB_PRECISIONS
    from powerlens._src.models.reader import FLOAT_NAMES
    assert set(DTYPES) <= set(FLOAT_NAMES) and set(PRECISIONS) <= set(LIB_PRECISIONS)
