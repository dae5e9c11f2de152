"""SmolLM2-135M (Q4_1 GGUF) against transformers' GGUF loader of the same file, float32.

Both sides dequantise the same blocks with ``gguf`` and run in float32, so they differ by
rounding only. Measured on three prompts (5, 8 and 4 tokens, run unpadded by transformers,
as one right-padded batch by powerlens):

* logits at the last valid token: max |diff| 6e-5 (1.4e-4 over every valid position) for
  logits of magnitude ~20, i.e. ~3e-6 of the logit scale; tolerance ``LOGIT_ATOL`` = 5e-4;
* top-5 probabilities: relative diff <= 2e-5 (softmax of logits 6e-5 apart moves a
  probability by at most ~1.2e-4 relative); tolerance ``PROB_RTOL`` = 2e-4;
* hidden states: the residual stream grows to ~8e3 (SmolLM2's massive activations), max
  |diff| 0.04 there, at most 9e-6 of each state's own max |value|; tolerance ``STATE_RTOL``
  = 5e-5 of that max, per recorded state.

transformers' ``hidden_states`` has 31 entries: the embeddings, the outputs of blocks
0..28, then the final norm of block 29's output (not the output itself). ``pl.trace``'s
``states`` (31) are the residual stream x_0..x_30 and never normed, so its last state is
compared after the final norm; ``pl.hidden_states(...).hf`` puts the normed one there itself.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

import powerlens as pl  # noqa: E402
from powerlens._src.models import CheckpointError, resolve  # noqa: E402
from powerlens._src.models.forward import final_norm  # noqa: E402

PROMPTS = ["The capital of France is", "Power iteration finds the top eigenvector,", "Once upon a time"]
LOGIT_ATOL = 5e-4
PROB_RTOL = 2e-4
STATE_RTOL = 5e-5


@pytest.fixture(scope="module")
def smol():
    """powerlens's SmolLM2, transformers' model and tokenizer of the same GGUF file (as
    test_generate's ``smol_pair``, plus the tokenizer, read while the file is parsed once), and
    transformers' outputs for each prompt, unpadded."""
    pytest.importorskip("gguf")
    from gguf_reference import gguf_parsed_once_in_memory
    try:
        path = resolve("smollm2")
    except CheckpointError as exc:
        pytest.skip(f"SmolLM2 GGUF not installed: {exc}")
    folder, name = os.path.dirname(path), os.path.basename(path)
    with gguf_parsed_once_in_memory():
        ref = tf.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
        tok = tf.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = pl.load("smollm2")
    ids = pl.tokenize(model, PROMPTS)
    assert ids == [tok(p)["input_ids"] for p in PROMPTS]           # the same tokens on both sides
    hf_logits, hf_states = [], []
    with torch.no_grad():
        for i in ids:
            out = ref(torch.tensor([i]), output_hidden_states=True)
            hf_logits.append(out.logits[0].numpy())                    # "float[n V]"
            hf_states.append(np.stack([h[0].numpy() for h in out.hidden_states]))   # "float[31 n d]"
    x0, valid = pl.embed(model, PROMPTS)
    return dict(model=model, tok=tok, ids=ids, x0=x0, valid=np.asarray(valid), hf_logits=hf_logits,
                hf_states=hf_states)


def _last(smol):
    return [len(i) - 1 for i in smol["ids"]]


@pytest.fixture(scope="module")
def next_logits(smol):
    """``pl.logits(model, pl.hidden_states(model, x0, valid)[-1])`` at each prompt's last token."""
    model = smol["model"]
    hs = pl.hidden_states(model, smol["x0"], smol["valid"])
    lg = np.asarray(pl.logits(model, hs[-1]))
    return hs, np.stack([lg[b, t] for b, t in enumerate(_last(smol))])


def test_logits_of_the_last_hidden_state_are_transformers(smol, next_logits):
    _, ours = next_logits
    for b, t in enumerate(_last(smol)):
        ref = smol["hf_logits"][b][t]
        diff = float(np.abs(ours[b] - ref).max())
        print(f"prompt {b}: max |logit diff| {diff:.2e}, max |logit| {np.abs(ref).max():.1f}")
        np.testing.assert_allclose(ours[b], ref, atol=LOGIT_ATOL, rtol=0, err_msg=PROMPTS[b])


def test_top_tokens_are_transformers_softmax_top5(smol, next_logits):
    _, ours = next_logits
    for b, t in enumerate(_last(smol)):
        probs, top = torch.softmax(torch.tensor(smol["hf_logits"][b][t]), dim=-1).topk(5)
        got = pl.top_tokens(smol["model"], ours[b], k=5)
        assert [g.id for g in got] == top.tolist()
        assert [g.text for g in got] == [smol["tok"].decode([i]) for i in top.tolist()]
        np.testing.assert_allclose([g.prob for g in got], probs.numpy(), rtol=PROB_RTOL, atol=0, err_msg=PROMPTS[b])
    assert pl.top_tokens(smol["model"], ours[0], k=5)[0].text == " Paris"


def _check_states(ours, ref, what):
    """ours, ref "float[K n d]": each state within STATE_RTOL of its own max |value|."""
    assert ours.shape == ref.shape, what
    scale = np.abs(ref).max(axis=(1, 2))
    err = np.abs(ours - ref).max(axis=(1, 2))
    print(f"{what}: max |diff| {err.max():.2e}, max relative to the state's scale {(err / scale).max():.2e}")
    bad = np.flatnonzero(err > STATE_RTOL * scale)
    assert bad.size == 0, f"{what}: states {bad.tolist()} differ by {err[bad]} (scales {scale[bad]})"


def test_hidden_states_hf_are_transformers(smol, next_logits):
    """pl.hidden_states(...).hf is transformers' tuple, its last entry normed."""
    hs, _ = next_logits
    assert hs.final_norm_in_hf and len(hs) == 31
    hf = np.asarray(hs.hf)
    for b, n in enumerate(len(i) for i in smol["ids"]):
        _check_states(hf[:, b, :n], smol["hf_states"][b], f"hidden_states prompt {b}")


def test_trace_full_states_and_logits_are_transformers(smol):
    model = smol["model"]
    tr = pl.trace(model, PROMPTS, rule="full")
    assert tr.rule == "full" and list(tr.layer) == list(range(30))
    np.testing.assert_array_equal(tr.valid, smol["valid"])
    states = np.asarray(tr.states)                                   # "float[31 B n d]" x_0..x_30, never normed
    assert states.shape[0] == 31
    for b, n in enumerate(len(i) for i in smol["ids"]):
        ref = smol["hf_states"][b]                                   # embeddings, blocks 0..28, norm(block 29)
        _check_states(states[:-1, b, :n], ref[:-1], f"trace prompt {b}, x_0..x_29")
        normed = np.asarray(final_norm(model, tr.outputs[-1][b, :n]))
        _check_states(normed[None], ref[-1:], f"trace prompt {b}, final norm of x_30")
        # the un-normed x_30 is not transformers' last entry: the norm is what the two differ by
        assert np.abs(states[-1, b, :n] - ref[-1]).max() > 100 * STATE_RTOL * np.abs(ref[-1]).max()
        logits = np.asarray(tr.logits)[b, :n]
        diff = float(np.abs(logits - smol["hf_logits"][b]).max())
        print(f"trace prompt {b}: max |logit diff| over its {n} tokens {diff:.2e}")
        np.testing.assert_allclose(logits, smol["hf_logits"][b], atol=LOGIT_ATOL, rtol=0, err_msg=PROMPTS[b])
        np.testing.assert_allclose(np.asarray(tr.next_logits)[b], smol["hf_logits"][b][n - 1], atol=LOGIT_ATOL,
                                   rtol=0)
