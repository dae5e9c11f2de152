"""Greedy decoding (``pl.generate``) against transformers' ``generate(do_sample=False)``, token for token.

* Every decoder family of tests/hf_tiny_decoders.py (GPT-2, GPT-Neo, Llama, Mistral, Qwen2,
  Qwen3, Gemma 1/2/3, GPT-NeoX, OPT, Phi, Phi-3), tiny and random: three prompts of 7, 4 and
  5 tokens, 12 new tokens each. transformers runs them as one left-padded batch with its
  attention mask and a KV cache; powerlens as one right-padded buffer whose mask grows, with
  no cache. Sliding windows (3 tokens) are shorter than the prompts, so they matter.
* Near ties could flip an argmax between two correct implementations (float32 logits agree to
  about 1e-5): every step of transformers' own scores must have a top-2 margin of at least
  ``MARGIN``, so an agreement is never luck and a disagreement never a tie. Gemma 2's tiny
  default soft-caps the logits at 4, where tanh saturates to exact float32 ties between
  tokens; here it caps at 30 (Gemma 2's own value), which still bites and leaves clear margins.
* ``stop_at_eos``: with an end-of-sequence id that one prompt emits mid-way (read from the
  folder's generation_config.json), that prompt stops at it, EOS kept, as in transformers.
* SmolLM2-135M (Q4_1 GGUF) against transformers' GGUF loader of the same file: three text
  prompts, 12 tokens, ids and text.
* Bad inputs: one-line ValueErrors.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

import hf_tiny_decoders as T  # noqa: E402
import powerlens as pl  # noqa: E402
from powerlens._src.models import CheckpointError, resolve  # noqa: E402

NEW = 12
LENGTHS = (7, 4, 5)
MARGIN = 1e-3

CONFIGS = {
    # the position tables hold 7 + 12 tokens
    "gpt2": ("gpt2", dict(n_positions=32)),
    "gpt_neo": ("gpt_neo", dict(max_position_embeddings=32)),
    "llama": ("llama", dict(rope_theta=500.0)),
    "mistral": ("mistral", dict()),
    "qwen2": ("qwen2", dict()),
    "qwen3": ("qwen3", dict()),
    "gemma": ("gemma", dict()),
    "gemma2": ("gemma2", dict(final_logit_softcapping=30.0)),       # see the module docstring
    "gemma3": ("gemma3_text", dict()),
    "gpt_neox": ("gpt_neox", dict()),
    "opt": ("opt", dict()),
    "phi": ("phi", dict()),
    "phi3": ("phi3", dict()),
}

case = T.case_fixture(CONFIGS, seed=40)


def random_prompts(seed: int = 3):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, T.VOCAB, L)] for L in LENGTHS]


def hf_greedy(hf, prompts, new: int = NEW, *, eos=None, pad: int = 0):
    """transformers' greedy continuations of ``prompts`` (lists of ids) as one left-padded batch
    with its attention mask: (new ids per prompt, cut after the first ``eos``; the top-2 margin
    of its scores at every step where a prompt was still going)."""
    n, B = max(map(len, prompts)), len(prompts)
    ids, mask = np.full((B, n), pad, np.int64), np.zeros((B, n), np.int64)
    for b, p in enumerate(prompts):
        ids[b, n - len(p):], mask[b, n - len(p):] = p, 1
    saved = hf.generation_config.eos_token_id
    hf.generation_config.eos_token_id = eos                 # None: no early stop, exactly `new` tokens
    try:
        with torch.no_grad():
            out = hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                              max_new_tokens=new, pad_token_id=pad, output_scores=True, return_dict_in_generate=True)
    finally:
        hf.generation_config.eos_token_id = saved
    seqs = out.sequences[:, n:].numpy()
    top2 = np.sort(torch.stack(out.scores, 1).double().numpy(), -1)[..., -2:]        # (B, steps, 2)
    rows, margins = [], []
    for b in range(B):
        row = [int(t) for t in seqs[b]]
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        rows.append(row)
        margins.extend(top2[b, : len(row), 1] - top2[b, : len(row), 0])
    return rows, float(min(margins))


def test_greedy_matches_transformers(case):
    prompts = random_prompts()
    ref, margin = hf_greedy(case["hf"], prompts)
    assert margin >= MARGIN, f"{case['name']}: transformers' top-2 margin {margin:.2e}: a near tie, pick another seed"
    out = pl.generate(case["model"], prompts, max_new_tokens=NEW)
    assert out.prompt_ids == prompts
    assert [len(r) for r in ref] == [NEW] * len(prompts)
    assert out.new_ids == ref, case["name"]
    assert out.text is None                                   # a tiny random model has no tokenizer


def _eos_case(new_ids):
    """(prompt, step) of an id that first appears mid-way (step >= 1) in one prompt's continuation
    and not in every prompt's first tokens, so EOS stops that prompt and not the batch."""
    for b, row in enumerate(new_ids):
        for j in range(1, len(row) - 1):
            if row[j] not in row[:j] and not all(row[j] in r[: j + 1] for r in new_ids):
                return b, j
    raise AssertionError(f"no id appears first mid-way in {new_ids}")


@pytest.mark.parametrize("case", ["llama"], indirect=True)
def test_stop_at_eos_with_the_checkpoints_eos(case, tmp_path):
    prompts = random_prompts()
    full = pl.generate(case["model"], prompts, max_new_tokens=NEW).new_ids
    b, j = _eos_case(full)
    eos = full[b][j]

    def with_eos(cfg):
        cfg["eos_token_id"] = eos
    folder = T.edited_copy(case["folder"], tmp_path, with_eos)
    gen_path = os.path.join(folder, "generation_config.json")
    gen = json.load(open(gen_path))
    gen["eos_token_id"] = eos
    json.dump(gen, open(gen_path, "w"))
    out = pl.generate(pl.load(folder), prompts, max_new_tokens=NEW, stop_at_eos=True)
    ref, margin = hf_greedy(case["hf"], prompts, eos=eos)
    assert margin >= MARGIN
    assert out.new_ids == ref
    assert out.new_ids[b] == full[b][: j + 1] and len(out.new_ids[b]) == j + 1 < NEW
    assert any(len(r) == NEW for r in out.new_ids)          # the other prompts went on
    # the same with the id given, on the model without it in its files
    assert pl.generate(case["model"], prompts, max_new_tokens=NEW, stop_at_eos=True,
                       eos_token_id=[eos]).new_ids == ref


@pytest.mark.parametrize("case", ["gpt2"], indirect=True)
def test_bad_inputs(case):
    model = case["model"]
    prompts = random_prompts()
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match=r"max_new_tokens must be an integer >= 1"):
            pl.generate(model, prompts, max_new_tokens=bad)
    with pytest.raises(ValueError, match=r"the longest prompt \(25 tokens\) plus max_new_tokens=12 needs 37 "
                                         r"positions; the model \(gpt2\) has 32"):
        pl.generate(model, [[1] * 25, [2]], max_new_tokens=12)
    with pytest.raises(ValueError, match=r"out of range \[0, 61\)"):
        pl.generate(model, [[1, 2, 61]])
    with pytest.raises(ValueError, match=r"prompt 1 is empty"):
        pl.generate(model, [[1, 2], []])
    with pytest.raises(ValueError, match=r"prompt 0's token ids must be integers, got dtype float64"):
        pl.generate(model, [[1, 1.5]])
    with pytest.raises(ValueError, match=r"prompt 1's token ids must be integers, got dtype bool"):
        pl.generate(model, [[1], [True]])
    with pytest.raises(ValueError, match=r"eos_token_id must be token ids in \[0, 61\)"):
        pl.generate(model, prompts, stop_at_eos=True, eos_token_id=61)
    encoder = model.replace(info=dataclasses.replace(model.info, decoder=False, family="bert"))
    with pytest.raises(ValueError, match=r"is not a causal decoder \(family bert\)"):
        pl.generate(encoder, prompts)
    with pytest.raises(CheckpointError, match=r"has no tokenizer"):
        pl.generate(model, ["a text prompt"])


# ----------------------------------------------------------------------------- SmolLM2 (GGUF)

SMOL_PROMPTS = ["The capital of France is", "Power iteration finds the top eigenvector,", "Once upon a time"]


@pytest.fixture(scope="module")
def smol_pair():
    """powerlens's SmolLM2 and transformers' reading of the same GGUF file (float32)."""
    pytest.importorskip("gguf")
    from gguf_reference import gguf_parsed_once_in_memory
    try:
        path = resolve("smollm2")
    except CheckpointError as exc:
        pytest.skip(f"SmolLM2 GGUF not installed: {exc}")
    with gguf_parsed_once_in_memory():
        ref = tf.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                      dtype=torch.float32)
    return pl.load("smollm2"), ref.eval()


def test_smollm2_greedy_matches_transformers(smol_pair):
    model, ref_model = smol_pair
    out = pl.generate(model, SMOL_PROMPTS, max_new_tokens=NEW)
    ref, margin = hf_greedy(ref_model, out.prompt_ids)
    assert margin >= MARGIN
    assert out.prompt_ids == pl.tokenize(model, SMOL_PROMPTS)
    assert out.new_ids == ref
    assert out.text == [pl.decode(model, r) for r in ref]
    assert out.text[0].startswith(" Paris"), out.text
