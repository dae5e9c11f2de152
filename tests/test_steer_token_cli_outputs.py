"""What ``powerlens steer MODEL --objective token --optimize`` writes and prints, on a tiny random
Llama folder (tests/hf_tiny_decoders.py) with a word-level ``tokenizer.json``: one CLI run with
``--controls FILE``, ``--paraphrases FILE`` and ``--layer 1`` (of 3), checked against independent
computations through the public API (pl.steered_model, pl.run_states(rule="full"), pl.logits).

On this model (seed 1) the target ``London`` starts at p ~ 0.04; p >= 0.5 at every prompt with
mean control KL <= 0.5 is reachable at layer 1 in 30 Adam steps (seeds 0 and 2 reach neither
that nor 0.3 at KL 5 on these prompts)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import powerlens as pl  # noqa: E402
from next_token import last_token_probs  # noqa: E402
from powerlens._src.steering.token import CONTROL_PROMPTS  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import hf_tiny_decoders as T  # noqa: E402

METHODS = ("closed_form_paper_alpha", "closed_form_token_alpha", "gradient", "activation_addition")
PROMPTS = ["The capital of France is", "The French capital is"]
CONTROLS = ["Rome is a city where the weather was", "He read the report and"]
PARAPHRASES = ["The capital city of France is", "France has a capital called", "Its capital is"]
LAYER, N_LAYERS, TARGET_PROB, MAX_KL, VOCAB, SEED = 1, 3, 0.5, 0.5, 61, 1


def _write_tokenizer(folder):
    """A WordLevel tokenizer.json over exactly VOCAB words (every id of the model decodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    words = ["[UNK]", "London"]
    for t in PROMPTS + CONTROLS + PARAPHRASES + list(CONTROL_PROMPTS):
        words += [w for w in re.findall(r"\w+|[^\w\s]", t) if w not in words]
    words += [f"filler{i}" for i in range(VOCAB - len(words))]
    assert len(words) == VOCAB and len(set(words)) == VOCAB
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("steer_token_outputs")
    folder = root / "tiny"
    T.build("llama", str(folder), seed=SEED, head=True, vocab_size=VOCAB, num_hidden_layers=N_LAYERS)
    _write_tokenizer(folder)
    (root / "controls.txt").write_text("\n".join(CONTROLS) + "\n")
    (root / "paraphrases.txt").write_text("\n".join(PARAPHRASES) + "\n")
    out = root / "out"
    from powerlens.cli import main
    argv = ["steer", str(folder), "--direction", "token:London", "--optimize", "--objective", "token",
            "--target-prob", str(TARGET_PROB), "--max-kl", str(MAX_KL), "--steps", "30", "--layer", str(LAYER),
            "--controls", str(root / "controls.txt"), "--paraphrases", str(root / "paraphrases.txt"),
            "--out", str(out)]
    for p in PROMPTS:
        argv += ["--text", p]
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        code = main(argv)
    assert code == 0, errors.getvalue()
    doc = json.loads((out / "steer.json").read_text())
    model = pl.load(str(folder))
    return dict(doc=doc, out=out, model=model, printed=printed.getvalue(),
                delta=np.load(out / "delta_O.npy"))


def _kl(p, q):
    return np.sum(p * (np.log(p) - np.log(q)), axis=-1)


def test_controls_and_paraphrase_files_are_the_prompts_used(run):
    """steer.json records the files' prompts; each condition has one paraphrase result per line,
    equal to the independently computed p(target); the gradient's control KL is that of the
    --controls prompts (and not that of the shipped defaults)."""
    doc, model, delta = run["doc"], run["model"], run["delta"]
    assert doc["prompts"] == PROMPTS
    assert doc["controls"] == CONTROLS and doc["paraphrases"] == PARAPHRASES
    tid = doc["effects"]["target_id"]
    conds = doc["effects"]["conditions"]
    for name in ("before",) + METHODS:
        para = conds[name]["paraphrases"]
        assert para["prompts"] == PARAPHRASES, name
        assert len(para["target_prob"]) == len(PARAPHRASES), name
        assert para["target_prob_mean"] == pytest.approx(np.mean(para["target_prob"]), abs=1e-12)
    steered = pl.steered_model(model, delta, LAYER)
    np.testing.assert_allclose(last_token_probs(model, PARAPHRASES)[:, tid], conds["before"]["paraphrases"]["target_prob"],
                               atol=1e-4)
    np.testing.assert_allclose(last_token_probs(steered, PARAPHRASES)[:, tid],
                               conds["gradient"]["paraphrases"]["target_prob"], atol=1e-3)
    kl_file = _kl(last_token_probs(model, CONTROLS), last_token_probs(steered, CONTROLS)).mean()
    kl_default = _kl(last_token_probs(model, list(CONTROL_PROMPTS)), last_token_probs(steered, list(CONTROL_PROMPTS))).mean()
    assert conds["gradient"]["control_kl_mean"] == pytest.approx(kl_file, rel=1e-2, abs=1e-4)
    assert abs(kl_file - kl_default) > 0.05 * kl_file           # the check tells the two sets apart
    assert conds["gradient"]["control_kl_mean"] <= MAX_KL + 1e-3


def test_layer_option_edits_that_layer(run):
    """--layer 1 is reported, and delta_O.npy applied to layer 1 gives the reported target
    probabilities and layer-output change (applied to the last layer it does not)."""
    doc, model, delta = run["doc"], run["model"], run["delta"]
    assert doc["layer"] == doc["effects"]["layer"] == LAYER
    assert doc["effects"]["conditions"]["gradient"]["layer"] == LAYER
    assert "layer 1" in run["printed"]
    assert delta.shape == (model.layers.config.d_model, model.layers.W_o.shape[-1])
    tid = doc["effects"]["target_id"]
    grad = doc["effects"]["conditions"]["gradient"]
    p = last_token_probs(pl.steered_model(model, delta, LAYER), PROMPTS)[:, tid]
    np.testing.assert_allclose(p, grad["target_prob"], atol=1e-3)
    assert np.all(p >= TARGET_PROB - 1e-3)
    wrong = last_token_probs(pl.steered_model(model, delta, N_LAYERS - 1), PROMPTS)[:, tid]
    assert np.max(np.abs(wrong - p)) > 1e-2
    # beta: ||change of layer 1's output||_F over the prompts' valid tokens (state index layer + 1)
    x0, valid = pl.embed(model, PROMPTS)
    v = np.asarray(valid, bool)
    s0 = np.asarray(pl.run_states(model, x0, valid, rule="full")[LAYER + 1], np.float64)
    s1 = np.asarray(pl.run_states(pl.steered_model(model, delta, LAYER), x0, valid, rule="full")[LAYER + 1], np.float64)
    assert grad["layer_output_change"] == pytest.approx(np.linalg.norm((s1 - s0)[v]), rel=1e-3)


def test_every_condition_has_every_measure(run):
    doc, model, delta = run["doc"], run["model"], run["delta"]
    tid = doc["effects"]["target_id"]
    conds = doc["effects"]["conditions"]
    assert set(conds) == {"before", *METHODS}
    for name in ("before",) + METHODS:
        c = conds[name]
        assert len(c["target_prob"]) == len(PROMPTS), name
        assert all(0.0 <= p <= 1.0 for p in c["target_prob"])
        # gradient / activation_addition: "target_prob" is the optimiser's (float32) list, the mean is
        # edit_effects' own measurement; they agree to float32 rounding
        assert c["target_prob_mean"] == pytest.approx(np.mean(c["target_prob"]), abs=1e-12), name
        assert c["control_kl_mean"] >= 0.0 and np.isfinite(c["delta_norm"]) and np.isfinite(c["layer_output_change"])
        assert len(c["continuation"]) == len(PROMPTS)
        assert all(isinstance(s, str) and s.strip() for s in c["continuation"]), name
        assert len(c["topk"]) == len(c["target_rank"]) == len(PROMPTS)
        for b, (row, rank) in enumerate(zip(c["topk"], c["target_rank"])):
            assert len(row) == 5 and all(isinstance(t["token"], str) and t["token"] for t in row)
            probs = [t["prob"] for t in row]
            assert probs == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-6
            ids = [t["id"] for t in row]
            if tid in ids:
                assert rank == ids.index(tid) + 1
                assert probs[ids.index(tid)] == pytest.approx(c["target_prob"][b], abs=1e-6)
            else:
                assert rank > 5 and c["target_prob"][b] <= probs[-1] + 1e-6
            # the first continued word is the top-1 token (greedy)
            assert c["continuation"][b].split()[0] == row[0]["token"]
    before = conds["before"]
    assert before["delta_norm"] == 0.0 and before["control_kl_mean"] == 0.0 and before["layer_output_change"] == 0.0
    grad = conds["gradient"]
    assert grad["delta_norm"] == pytest.approx(np.linalg.norm(delta.astype(np.float64)), rel=1e-6)
    assert grad["delta_rank"] == np.linalg.matrix_rank(delta, tol=1e-5 * np.linalg.norm(delta)) == 1
    assert grad["feasible"] and min(grad["target_prob"]) >= TARGET_PROB - 1e-3
    for name in ("closed_form_paper_alpha", "closed_form_token_alpha"):     # dO = alpha u w^T, unit u and w
        assert conds[name]["delta_norm"] == pytest.approx(conds[name]["alpha"], rel=1e-5)
    assert conds["closed_form_token_alpha"]["reaches_target_prob"]
    assert min(conds["closed_form_token_alpha"]["target_prob"]) >= TARGET_PROB - 1e-3
    # the top-5 of the gradient edit, recomputed
    p = last_token_probs(pl.steered_model(model, delta, LAYER), PROMPTS)
    for b in range(len(PROMPTS)):
        assert [t["id"] for t in grad["topk"][b]] == list(np.argsort(-p[b])[:5])
        assert grad["target_rank"][b] == 1 + int(np.sum(p[b] > p[b, tid]))
    # the frontier's gradient curve holds this run's point
    curve = doc["frontier"]["curves"]["gradient ΔO, rank ≤ 1"]
    assert any(pt["layer_output_change"] == pytest.approx(grad["layer_output_change"], rel=1e-6)
               and pt["target_prob_mean"] == pytest.approx(grad["target_prob_mean"], abs=1e-6) for pt in curve)


def test_frontier_png_is_a_picture(run):
    import matplotlib.image as mpimg
    path = run["out"] / "frontier.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(str(path))
    assert img.ndim == 3 and img.shape[2] in (3, 4)
    h, w = img.shape[:2]
    assert 300 <= h <= 700 and 600 <= w <= 1100 and w > h           # 7 x 4.4 in at 120 dpi, tight bbox
    assert np.ptp(img[..., :3]) > 0.5                                  # not blank


def test_printed_output_calls_only_the_closed_forms_alpha(run):
    doc, printed = run["doc"], run["printed"]
    conds = doc["effects"]["conditions"]
    lines = {ln.split()[0]: ln for ln in printed.splitlines() if ln.startswith("  ") and ln.split()}
    grad, act = lines["gradient"], lines["activation_addition"]
    assert "alpha" not in grad.lower() and "α" not in grad
    assert f"||dO||_F={conds['gradient']['delta_norm']:.4g} (rank {conds['gradient']['delta_rank']})" in grad
    assert "alpha" not in act.lower() and "α" not in act and "||dO||" not in act
    assert f"||v||={conds['activation_addition']['delta_norm']:.4g}" in act
    for name in ("closed_form_paper_alpha", "closed_form_token_alpha"):
        assert f"alpha={conds[name]['alpha']:.4g}" in lines[name]
    # "alpha" appears only on the closed-form lines
    alpha_lines = [ln for ln in printed.splitlines() if "alpha=" in ln or "α" in ln]
    assert all(ln.split()[0].startswith("closed_form_") for ln in alpha_lines)
    for name in ("before",) + METHODS:
        assert f"p mean {conds[name]['target_prob_mean']:.3f}" in lines[name]
