"""What a short command loads, and the pieces that keep it short.

* No module of powerlens imports flax: the pytrees are :mod:`powerlens._src.dynamics.struct`
  (``jax.tree_util.register_dataclass``), with flax's semantics: frozen, ``replace``, static
  fields in the tree structure, leaves the other fields.
* ``powerlens align``'s modules import neither flax nor matplotlib up front (the figure's
  modules are imported while the spectra are computed).
* A GGUF file's tokenizer is ``tokenizers`` alone: no transformers in the process, and the ids,
  BOS/EOS ids and decoding SmolLM2's file gives.
* :class:`powerlens._src.commands.models.InBackground` returns the value, or raises the exception,
  of the function it ran; an error in ``align`` while the spectra run in it exits with status 2.
"""
from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "powerlens")


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_no_module_of_powerlens_imports_flax():
    importers = []
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                tree = ast.parse(open(path, encoding="utf-8").read(), path)
                for node in ast.walk(tree):
                    names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                             [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                    if any(n == "flax" or n.startswith("flax.") for n in names):
                        importers.append(os.path.relpath(path, ROOT))
    assert importers == []


def test_struct_dataclass_is_a_frozen_pytree_with_static_fields():
    from powerlens._src.dynamics import struct

    @struct.dataclass
    class Pair:
        a: jax.Array
        b: jax.Array
        name: str = struct.field(pytree_node=False, default="x")

    p = Pair(jnp.ones(2), jnp.zeros(3))
    leaves, tree = jax.tree_util.tree_flatten(p)
    assert [np.shape(v) for v in leaves] == [(2,), (3,)]                  # the static field is no leaf
    assert jax.tree_util.tree_structure(p.replace(name="y")) != tree       # ... but part of the structure
    assert jax.tree_util.tree_unflatten(tree, [jnp.full(2, 5.0), leaves[1]]).a.tolist() == [5.0, 5.0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.a = jnp.zeros(2)
    doubled = jax.jit(lambda q: jax.tree_util.tree_map(lambda v: 2 * v, q))(Pair(jnp.ones(2), jnp.ones(1), "z"))
    assert doubled.a.tolist() == [2.0, 2.0] and doubled.name == "z"
    keys = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(p)[0]]
    assert keys == [".a", ".b"]


def test_the_library_pytrees_keep_their_static_config():
    from powerlens._src.dynamics import Layers
    from powerlens._src.dynamics.synthetic import synthetic_system
    layers = synthetic_system([2.0, 0.5], kind="normal", heads=1, d=4, steps=3)
    assert isinstance(layers, Layers)
    leaves, tree = jax.tree_util.tree_flatten(layers)
    assert all(isinstance(v, (jax.Array, np.ndarray)) for v in leaves)
    assert jax.tree_util.tree_unflatten(tree, leaves).config == layers.config
    assert layers.replace(W_v=2 * layers.W_v).config is layers.config


def test_align_modules_import_no_flax_and_no_matplotlib():
    code = ("import sys\nimport powerlens._src.commands.models, powerlens._src.models, powerlens._src.sweeps.systems\n"
            "print(sorted(m for m in ('flax', 'matplotlib', 'transformers', 'torch') if m in sys.modules))")
    r = _python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_gguf_tokenizer_is_tokenizers_without_transformers():
    from powerlens._src.models import CheckpointError, resolve
    try:
        path = resolve("smollm2")
    except CheckpointError as exc:
        pytest.skip(f"SmolLM2 GGUF not installed: {exc}")
    code = f"""
import sys
from powerlens._src.models.embed import FolderTokenizer
from powerlens._src.models.gguf_tokenizer import gguf_tokenizer
tok = gguf_tokenizer({path!r})
ids = tok("The capital of France is")["input_ids"]
chat = tok("<|im_start|>user\\nhi<|im_end|>")["input_ids"]
print(isinstance(tok, FolderTokenizer), ids, tok.bos_token_id, tok.eos_token_id, chat[0], chat[-1],
      repr(tok.decode(chat, skip_special_tokens=True)), tok.convert_ids_to_tokens(tok(" Paris")["input_ids"]))
print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))
"""
    r = _python(code)
    assert r.returncode == 0, r.stderr
    first, loaded = r.stdout.strip().splitlines()
    assert first == "True [504, 3575, 282, 4649, 314] 1 2 1 2 'user\\nhi' ['ĠParis']"
    assert loaded == "[]"


def test_in_background_returns_the_value_or_raises_the_error():
    from powerlens._src.commands.models import InBackground
    assert InBackground(lambda a, b=0: a + b, 2, b=3).result() == 5

    def fails():
        raise ValueError("F of layer 3 has non-finite eigenvalues")

    job = InBackground(fails)
    with pytest.raises(ValueError, match="layer 3"):
        job.result()


def test_an_error_beside_the_background_spectra_exits_with_status_2(tmp_path):
    """The prompt is refused while the eigen-decompositions still run in their thread: the
    process exits at once with the one-line error (never an abort from a thread left in XLA)."""
    r = subprocess.run([sys.executable, "-m", "powerlens.cli", "align", "minilm", "--text", "word " * 600,
                        "--out", str(tmp_path / "out"), "--quiet"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        "powerlens align: error: prompt of 602 tokens is longer than the model's 512 positions (bert); "
        "shorten it (powerlens does not truncate silently)"]
    assert not (tmp_path / "out").exists()
