"""Option values, missing files, unreadable specs and unknown model names are refused before
any numerical library is imported: one line, exit status 2, and none of jax, scipy,
matplotlib or transformers in ``sys.modules`` afterwards (every case in one fresh process, in turn)."""
from __future__ import annotations

import json
import os

import pytest
from cli_probe import probe

HEAVY = ("jax", "scipy", "matplotlib", "transformers")

# argv (run in a folder holding bad.toml and nothing else) -> the message's fragment
CASES = {
    "simulate --spectrum 2,1 --steps 0 --out o": "--steps must be a positive integer, got 0",
    "simulate --spectrum 2,1 --tokens 0 --out o": "--tokens must be positive, got 0",
    "simulate --spectrum 2,1 --batch -3 --out o": "--batch must be positive, got -3",
    "simulate --spectrum 2,1 --heads 0 --out o": "--heads must be positive, got 0",
    "simulate --spectrum 2,1 --dim 0 --out o": "--dim must be positive, got 0",
    "simulate --spectrum 2,1 --beta nan --out o": "--beta must be finite, got nan",
    "simulate --weights missing.npz --out o": "--weights file 'missing.npz' does not exist",
    "simulate --spectrum 2,1 --weights missing.npz --out o": "give either --weights or --spectrum, not both",
    "simulate --spectrum 2,1 --init missing.npy --out o": "--init file 'missing.npy' does not exist",
    "simulate --out o": "give either --weights system.npz or --spectrum",
    "spectrum nosuchmodel --out o": "cannot find model 'nosuchmodel': not an alias (minilm, smollm2, gemma3)",
    "spectrum --weights missing.npz --out o": "--weights file 'missing.npz' does not exist",
    "align nosuchmodel --text hi --out o": "cannot find model 'nosuchmodel'",
    "align minilm --prompts missing.txt --out o": "--prompts file 'missing.txt' does not exist",
    "align minilm --out o": "no prompts: give --text",
    "align minilm --text hi --steps 5 --out o": "--shared-layer and --steps go together",
    "align minilm --text hi --shared-layer 0 --steps 0 --out o": "--steps must be a positive integer, got 0",
    "steer nosuchmodel --direction random --text hi --out o": "cannot find model 'nosuchmodel'",
    "steer minilm --direction missing.npy --text hi --out o": "--direction file 'missing.npy' does not exist",
    "steer minilm --direction token:Paris --objective token --controls no.txt --text hi --out o":
        "--controls file 'no.txt' does not exist",
    "sweep missing.toml --out o": "missing.toml: cannot read the spec (No such file or directory)",
    "sweep bad.toml --out o": "bad.toml: malformed TOML",
    "sweep bad.toml --out o --processes 0": "--processes must be a positive integer, got 0",
    "sweep bad.toml --out o --init-timeout 0": "--init-timeout must be positive",
    "reproduce --jobs 0 --out o": "--jobs must be a positive integer, got 0",
}

@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """Every case, in one fresh process (run in a folder holding bad.toml): argv -> (status,
    stderr lines, heavy modules loaded); and that folder."""
    folder = tmp_path_factory.mktemp("cases")
    (folder / "bad.toml").write_text("[grid]\nbeta = [1,\n")
    return probe(list(CASES), HEAVY, cwd=folder), folder


@pytest.mark.parametrize("argv", list(CASES))
def test_bad_values_and_paths_are_refused_before_any_numerical_import(refused, argv):
    seen, folder = refused
    status, lines, heavy = seen[argv]
    command = argv.split()[0]
    assert status == 2 and len(lines) == 1, (argv, lines)
    assert lines[0].startswith(f"powerlens {command}: error: ") and CASES[argv] in lines[0], (argv, lines)
    assert heavy == [], (argv, heavy)
    assert not (folder / "o").exists()


def test_a_hub_id_in_the_local_cache_and_a_path_are_known(tmp_path):
    """Only names that are certainly unknown are refused early: a hub id whose snapshot is in
    the local cache passes the check (and fails later, on its empty config, not on its name)."""
    from powerlens.cli import MODEL_ALIASES, check_model_name
    from powerlens._src.models.load import ALIASES, ASSEMBLED
    assert MODEL_ALIASES == (*ALIASES, *ASSEMBLED)
    snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"))
    status, lines, heavy = probe(["align org/tiny --text hi --out o"], HEAVY, cwd=tmp_path, env=env)[
        "align org/tiny --text hi --out o"]
    assert status == 2 and "cannot find model" not in lines[-1], lines
    check_model_name(str(snap))                                   # a path
    check_model_name("minilm")
    check_model_name("org/absent", allow_download=True)          # may be fetched
    with pytest.raises(ValueError, match="cannot find model 'org/absent'"):
        check_model_name("org/absent")


def test_metrics_record_only_the_options_that_applied(tmp_path):
    """A --weights run records no synthetic-system option (heads, kind, beta, dim: argparse
    defaults that built nothing), no unset option and no --norm under the paper rule; a
    --spectrum run records them."""
    import numpy as np
    from powerlens.cli import main
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "w.npz", W_q=rng.standard_normal((1, 2, 2)), W_k=rng.standard_normal((1, 2, 2)),
             W_v=rng.standard_normal((1, 2, 2)), W_o=0.3 * rng.standard_normal((2, 2)))
    assert main(["simulate", "--weights", str(tmp_path / "w.npz"), "--tokens", "3", "--quiet",
                 "--out", str(tmp_path / "a")]) == 0
    settings = json.loads((tmp_path / "a" / "metrics.json").read_text())["settings"]
    assert not {"heads", "kind", "beta", "dim", "spectrum", "norm", "init", "steps"} & set(settings), settings
    assert settings["weights"] == str(tmp_path / "w.npz") and settings["tokens"] == 3 and settings["rule"] == "paper"
    assert main(["simulate", "--spectrum", "2,1", "--heads", "2", "--steps", "2", "--tokens", "3", "--quiet",
                 "--out", str(tmp_path / "b")]) == 0
    settings = json.loads((tmp_path / "b" / "metrics.json").read_text())["settings"]
    assert (settings["heads"], settings["kind"], settings["beta"], settings["steps"]) == (2, "normal", 1.0, 2)
    assert "weights" not in settings and "dim" not in settings
