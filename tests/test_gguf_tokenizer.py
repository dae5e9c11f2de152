"""The GGUF tokenizer, built from the file's metadata with ``tokenizers``, against transformers'
own GGUF tokenizer (the reference; it needs torch, so it is test-only).

Two files: SmolLM2's (model ``gpt2``: byte-level BPE with merges) and a small file with the
``llama`` model (SentencePiece-style: "▁" marker, byte fallback, merges recovered from the
scores) written here with ``gguf.GGUFWriter``. On 200+ varied strings the ids must be equal,
and so must the decoding.
"""
from __future__ import annotations

import collections
import os
import random
import re

import numpy as np
import pytest

from gguf_reference import gguf_parsed_once_in_memory
from powerlens._src.models.gguf_llama import GGUFFile
from powerlens._src.models.gguf_tokenizer import build_tokenizer, gguf_tokenizer, tokenizer_spec
from powerlens._src.models.load import resolve
from powerlens._src.models.reader import CheckpointError

FIXED = [
    "", " ", "  ", "\n", "\n\n\n", "\t", "\t\tx", "a", "The capital of France is",
    "The cat sat on the mat.", "   leading spaces", "trailing spaces   ", "many    inner     spaces",
    "line one\nline two\r\nline three\n\n", "tabs\tand\tnewlines\n\t\n", "0", "1234567890",
    "3.14159 2.71828 -1e-10 +6.02e23", "12,345,678.90 $ 100% #1", "émoji 🤗🎉👍🏽 and ZWJ 👨‍👩‍👧",
    "ünïcödé naïve café résumé", "中文 日本語 한국어", "Привет мир", "مرحبا بالعالم", "עברית",
    "ℝ^d ⊗ ∑_{i=1}^n x_i ≈ ∞", "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }", "<html><body class=\"x\">hi</body></html>",
    "{\"key\": [1, 2, {\"nested\": null}]}", "SELECT * FROM t WHERE id = 'x';", "path/to/file_name-v2.tar.gz",
    "https://example.com/a?b=c&d=e#frag", "user@example.com", "CamelCaseWordsAndsnake_case_words",
    "ALL CAPS SHOUTING!!!", "don't won't it's we're they've I'm you'll he'd", "...---!!!???",
    "\u00a0non-breaking\u00a0space", "zero\u200bwidth", "control\x01\x02chars", "a\u0301 combining",
]
SPECIALS = {"gpt2": ["<|endoftext|>", "<|im_start|>user\nhi<|im_end|>", "x<|endoftext|>y", "<|im_end|>\n"],
            "llama": ["<s>", "</s>", "<s>hello</s>", "a <s> b </s> c", "<unk>"]}


def varied_strings(specials, n=180, seed=0):
    """FIXED, the special-token strings, and n random compositions of their pieces."""
    rng = random.Random(seed)
    pieces = [p for s in FIXED for p in re.split(r"(\s+)", s) if p] + specials + [" ", "  ", "\n", "\t"]
    out = list(FIXED) + list(specials)
    for _ in range(n):
        out.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 8))))
    return out


def write_llama_vocab_gguf(path, corpus: str):
    """A small GGUF file with a ``llama``-model (SentencePiece) tokenizer and one tensor.

    Vocabulary: <unk>, <s>, </s>, the 256 byte tokens <0xXX>, every character of the corpus's
    words (with the "▁" word marker) and its 300 most frequent substrings, scored so that
    longer, more frequent pieces merge first. No merges are stored: they are recovered.
    """
    import gguf
    words = ["▁" + w for w in re.findall(r"\S+", corpus)]
    chars = sorted(set("".join(words)))
    counts = collections.Counter(w[i:j] for w in words for i in range(len(w)) for j in range(i + 2, min(len(w), i + 6) + 1))
    pieces = [p for p, c in counts.most_common(300) if c > 1]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + chars + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * (len(chars) + len(pieces))
    scores = [0.0] * 259 + [-1000.0 - i for i in range(len(chars))] + [-float(i) for i in range(len(pieces))]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def reference(path):
    from transformers import AutoTokenizer
    with gguf_parsed_once_in_memory():
        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                             local_files_only=True)


@pytest.fixture(scope="module")
def smollm2():
    path = resolve("smollm2")
    return build_tokenizer(tokenizer_spec(GGUFFile(path))), reference(path)


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    corpus = open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8").read()
    path = write_llama_vocab_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama-vocab.gguf", corpus)
    return path


@pytest.fixture(scope="module")
def llama_vocab(llama_file):
    return build_tokenizer(tokenizer_spec(GGUFFile(llama_file))), reference(llama_file)


def check_equal(ours, ref, strings):
    assert len(strings) >= 200
    bad = []
    for s in strings:
        a, b = ours(s)["input_ids"], ref(s)["input_ids"]
        if a != b or ours.decode(a) != ref.decode(b) or \
                ours.decode(a, skip_special_tokens=True) != ref.decode(b, skip_special_tokens=True):
            bad.append((s, a, b))
    assert not bad, f"{len(bad)} of {len(strings)} strings differ, first: {bad[0]!r}"


def test_smollm2_ids_and_decoding_equal_transformers(smollm2):
    check_equal(*smollm2, varied_strings(SPECIALS["gpt2"]))


def test_llama_model_ids_and_decoding_equal_transformers(llama_vocab):
    ours, ref = llama_vocab
    strings = varied_strings(SPECIALS["llama"], seed=1)
    check_equal(ours, ref, strings)
    ids = ours("the cat")["input_ids"]
    assert ids[0] == 1                                             # add_bos_token
    assert any(t.startswith("<0x") for t in ours.convert_ids_to_tokens(ours("🤗")["input_ids"]))  # byte fallback


def test_recovered_merges_are_cached_and_the_cached_tokenizer_is_the_same(llama_file, llama_vocab, tmp_path,
                                                                         monkeypatch):
    """A tokenizer whose merges were recovered is kept on disk, keyed by the file; read back,
    it gives the same ids and decoding as the one built from the metadata."""
    from powerlens._src.models import gguf_tokenizer as gt
    monkeypatch.setenv("POWERLENS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gt, "CACHE_MIN_TOKENS", 0)
    spec = tokenizer_spec(GGUFFile(llama_file))
    built = build_tokenizer(spec)
    cached = [f for _, _, fs in os.walk(tmp_path / "cache") for f in fs]
    assert len(cached) == 1 and cached[0].endswith(".json")
    monkeypatch.setattr(gt, "_recovered_merges", lambda *a: pytest.fail("the cache was not used"))
    again = build_tokenizer(spec)
    check_equal(again, llama_vocab[1], varied_strings(SPECIALS["llama"], seed=2))
    s = "the cat sat on the mat 🤗"
    assert again(s)["input_ids"] == built(s)["input_ids"]


def test_smollm2_known_ids(smollm2):
    """Independent of the reference: SmolLM2 adds no BOS and keeps its chat tokens whole."""
    ours, _ = smollm2
    assert ours("<|im_start|>user")["input_ids"][0] == 1
    assert ours.convert_ids_to_tokens(ours(" Paris")["input_ids"]) == ["ĠParis"]
    assert ours.decode(ours("a\n\tb 🤗")["input_ids"]) == "a\n\tb 🤗"


def test_loading_reads_the_file_once(monkeypatch):
    """The model's tokenizer comes from the spec read while loading: no second parse."""
    from powerlens._src.models import gguf_file, load
    from powerlens._src.models.embed import tokenizer
    path = resolve("smollm2")
    model = load("smollm2")
    monkeypatch.setattr(gguf_file, "GGUFFile", lambda *a, **k: pytest.fail("the GGUF file was parsed again"))
    tok = gguf_tokenizer(path)
    assert tok("The capital of France is")["input_ids"] == [504, 3575, 282, 4649, 314]
    assert tokenizer(model)("hi")["input_ids"] == tok("hi")["input_ids"]


class _Fake:
    def __init__(self, path, meta):
        self.path, self._meta = path, meta

    def meta(self, key, default=None):
        return self._meta.get(key, default)


def test_unknown_tokenizer_model_names_the_model_and_the_file():
    fake = _Fake("/x/model.gguf", {"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(CheckpointError, match=r"/x/model.gguf.*'rwkv'"):
        tokenizer_spec(fake)


def test_bad_metadata_is_a_checkpoint_error():
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]}
    with pytest.raises(CheckpointError, match="token_type has 1 entries for 2 tokens"):
        tokenizer_spec(_Fake("f.gguf", dict(base, **{"tokenizer.ggml.token_type": [1]})))
    with pytest.raises(CheckpointError, match="bos_token_id=7 is outside"):
        tokenizer_spec(_Fake("f.gguf", dict(base, **{"tokenizer.ggml.bos_token_id": 7})))
    with pytest.raises(CheckpointError, match="no tokenizer"):
        tokenizer_spec(_Fake("f.gguf", {}))
    with pytest.raises(CheckpointError, match=r"merges\[0\]"):
        build_tokenizer(tokenizer_spec(_Fake("f.gguf", dict(base, **{"tokenizer.ggml.merges": ["ab"]}))))
