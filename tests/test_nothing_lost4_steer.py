"""Issue "Nothing lost, round 4", the steering items: every unbounded or badly named ``steer``
option is refused in one line that names it (exit 2, nothing written), before any
optimisation runs.

    5   --rank above min(d, H e), too many --controls lines: refused before the optimiser
    8   --steps 10^12: refused at parse time (before any model loads)
    9   an over-long --paraphrases prompt: refused before the model runs, naming file and line
    13  --alpha 1e39: "overflows float32"; --alpha 1e37 on a float32 system: the change overflows
    14  --seed -1 (every command) and --layer 3 of 3 name the option and how layers count
    15  a model whose weights are x1e20: the overflow is named, not "lower --target-prob"

The model is a tiny random Llama folder (tests/hf_tiny_decoders.py, 3 layers, d = 48, H e = 48 (heads
times head size): min(d, H e) = 48, 32 positions) with a word-level tokenizer.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(__file__))
import hf_tiny_decoders as T  # noqa: E402
from test_steer_token_cli_outputs import _write_tokenizer  # noqa: E402

from powerlens.cli import main  # noqa: E402

PROMPT = ["--text", "The capital of France is"]
TOKEN = ["--direction", "token:London", "--optimize", "--objective", "token"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("nl4") / "tiny"
    T.build("llama", str(folder), seed=1, head=True, vocab_size=61, num_hidden_layers=3)
    _write_tokenizer(folder)
    return folder


@pytest.fixture
def no_optimiser(monkeypatch):
    """Any call of the optimiser fails the test: the refusal must come first."""
    import powerlens._src.steering as steering

    def refuse(*a, **k):
        raise AssertionError("the optimiser ran before the option was refused")

    monkeypatch.setattr(steering, "optimize_steering", refuse)


def _refused(capsys, tmp_path, argv, needle):
    out = tmp_path / "o"
    code = main(argv + ["--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()
    return err


def test_rank_above_min_d_He_is_refused_before_optimising(tiny, tmp_path, capsys, no_optimiser):
    _refused(capsys, tmp_path, ["steer", str(tiny), *TOKEN, *PROMPT, "--rank", "100000000"],
             "--rank 100000000 exceeds min(d, H*d_head) = min(48, 48) = 48")
    _refused(capsys, tmp_path, ["steer", str(tiny), *TOKEN, *PROMPT, "--rank", "49"], "--rank 49 exceeds")


def test_rank_bound_on_the_alignment_objective(tiny, tmp_path, capsys, no_optimiser):
    _refused(capsys, tmp_path, ["steer", str(tiny), "--direction", "token:London", "--optimize", *PROMPT,
                                "--rank", "1000"], "--rank 1000 exceeds min(d, H*d_head) = min(48, 48) = 48")


def test_too_many_control_lines(tiny, tmp_path, capsys, no_optimiser):
    from powerlens._src.commands.steer_limits import STEER_MAX_PROMPTS
    path = tmp_path / "controls.txt"
    path.write_text("He read the report and\n" * (STEER_MAX_PROMPTS + 1))
    _refused(capsys, tmp_path, ["steer", str(tiny), *TOKEN, *PROMPT, "--controls", str(path)],
             f"--controls file {str(path)!r} has {STEER_MAX_PROMPTS + 1} prompts; steer takes at most "
             f"{STEER_MAX_PROMPTS}")


@pytest.mark.parametrize("objective", [[], TOKEN])
def test_too_many_prompts(tiny, tmp_path, capsys, no_optimiser, objective):
    from powerlens._src.commands.steer_limits import STEER_MAX_PROMPTS
    path = tmp_path / "prompts.txt"
    path.write_text("The capital of France is\n" * STEER_MAX_PROMPTS)
    argv = ["steer", str(tiny), *(objective or ["--direction", "token:London"]), *PROMPT, "--prompts", str(path)]
    _refused(capsys, tmp_path, argv, f"{STEER_MAX_PROMPTS + 1} prompts (--text, --prompts); steer takes at most "
                                     f"{STEER_MAX_PROMPTS}")


def test_steps_bounded_at_parse_time(tmp_path, capsys):
    from powerlens._src.commands.steer_limits import STEER_MAX_STEPS
    _refused(capsys, tmp_path, ["steer", "no-such-model", *TOKEN, *PROMPT, "--steps", "1000000000000"],
             f"--steps 1000000000000 is more than {STEER_MAX_STEPS}, the most Adam steps steer runs")


def test_over_long_paraphrase_names_file_and_line(tiny, tmp_path, capsys, no_optimiser):
    path = tmp_path / "para.txt"
    path.write_text("The French capital is\n\n" + " ".join(["France"] * 40) + " is\n")
    _refused(capsys, tmp_path, ["steer", str(tiny), *TOKEN, *PROMPT, "--paraphrases", str(path)],
             f"--paraphrases file {str(path)!r} line 3: the prompt has 41 tokens, more than the model's 32 positions")


def test_over_long_control_names_file_and_line(tiny, tmp_path, capsys, no_optimiser):
    path = tmp_path / "c.txt"
    path.write_text(" ".join(["Rome"] * 33) + "\n")
    _refused(capsys, tmp_path, ["steer", str(tiny), *TOKEN, *PROMPT, "--controls", str(path)],
             f"--controls file {str(path)!r} line 1: the prompt has 33 tokens")


def test_alpha_beyond_float32_is_one_line(tmp_path, capsys):
    _refused(capsys, tmp_path, ["steer", "no-such-model", "--direction", "random", *PROMPT, "--alpha", "1e39"],
             "--alpha 1e+39 overflows float32 (the largest float32 is 3.4e+38)")


def test_alpha_whose_change_overflows_the_layer_dtype(tmp_path, capsys):
    """alpha = 1e38 is a float32, but the change alpha u w^T of the alignment curve (up to 10 alpha)
    is not: u = e_0 (|u|max = 1) and the unit w = V u / ||V u|| of H e = 4 entries has
    |w|max >= 1/2, so 10 alpha |u|max |w|max >= 5e38 > 3.4e38."""
    rng = np.random.default_rng(0)
    d, H, e = 4, 2, 2
    np.savez(tmp_path / "sys.npz", W_q=rng.normal(size=(H, e, d)), W_k=rng.normal(size=(H, e, d)),
             W_v=rng.normal(size=(H, e, d)), W_o=rng.normal(size=(d, H * e)))
    np.save(tmp_path / "x0.npy", rng.normal(size=(3, d)))
    np.save(tmp_path / "u.npy", np.eye(d)[0])                  # |u|max = 1
    err = _refused(capsys, tmp_path, ["steer", "--weights", str(tmp_path / "sys.npz"), "--init",
                                      str(tmp_path / "x0.npy"), "--direction", str(tmp_path / "u.npy"),
                                      "--w", "value", "--alpha", "1e38"], "--alpha 1e+38 overflows float32")
    assert "largest float32" in err


@pytest.mark.parametrize("argv", [
    ["steer", "no-such-model", "--direction", "random", "--text", "Hi"],
    ["simulate", "--spectrum", "2,0.5", "--dim", "4", "--tokens", "4", "--steps", "5", "--quiet"],
    ["align", "no-such-model", "--text", "Hi"],
])
def test_seed_names_the_option(tmp_path, capsys, argv):
    _refused(capsys, tmp_path, argv + ["--seed", "-1"], "--seed must be an integer in 0 .. 2147483647, got -1")


def test_reproduce_seed_names_the_option(tmp_path, capsys):
    code = main(["reproduce", "--quick", "--seed", "-1", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and "--seed must be an integer in 0 .. 2147483647, got -1" in err
    assert not (tmp_path / "r").exists()


def test_layer_out_of_range_says_how_layers_count(tiny, tmp_path, capsys, no_optimiser):
    _refused(capsys, tmp_path, ["steer", str(tiny), *TOKEN, *PROMPT, "--layer", "3"],
             "--layer 3 is out of range: the model has 3 layer(s), counted from 0 (0 .. 2); -1 is the last")
    _refused(capsys, tmp_path, ["steer", str(tiny), *TOKEN, *PROMPT, "--layer", "-4"], "--layer -4 is out of range")


def test_overflowing_weights_name_the_overflow(tiny, tmp_path, capsys, no_optimiser):
    """Every weight x1e20: the residual stream overflows float32 in the first block (the unedited
    logits are not finite), which is said, instead of "lower --target-prob"."""
    import shutil
    from safetensors.numpy import load_file, save_file
    big = tmp_path / "big"
    shutil.copytree(tiny, big)
    tensors = load_file(str(big / "model.safetensors"))
    save_file({k: (v * np.float32(1e20)).astype(v.dtype) for k, v in tensors.items()}, str(big / "model.safetensors"),
              metadata={"format": "pt"})
    err = _refused(capsys, tmp_path, ["steer", str(big), *TOKEN, *PROMPT], "overflowed float32")
    assert "are not finite before any edit" in err and "--target-prob" not in err
