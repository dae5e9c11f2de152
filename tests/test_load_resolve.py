"""Model resolution: aliases, the local Hugging Face cache (offline, no hub client), errors;
and the ALBERT group index in `powerlens spectrum MODEL`."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from hf_tiny import build
from powerlens.cli import main
from powerlens._src.models import load
from powerlens._src.models.load import hub_cache_path, resolve
from powerlens._src.models.reader import CheckpointError


@pytest.fixture()
def fake_cache(tmp_path, monkeypatch):
    """A Hugging Face cache with `tiny-org/tiny-albert` laid out as huggingface_hub does."""
    root = tmp_path / "hub"
    snap = root / "models--tiny-org--tiny-albert" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    build("albert", snap, seed=3)
    (root / "models--tiny-org--tiny-albert" / "refs").mkdir()
    (root / "models--tiny-org--tiny-albert" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return snap


def test_cached_hub_id_resolves_offline(fake_cache):
    assert hub_cache_path("tiny-org/tiny-albert") == str(fake_cache)
    assert resolve("tiny-org/tiny-albert") == str(fake_cache)
    model = load("tiny-org/tiny-albert")
    assert model.info.family == "albert"
    # 3 layers, 2 groups x 2 inner layers: 4 unique layers, 6 steps
    assert model.layers.n_unique == 4 and model.layers.schedule == (0, 1, 0, 1, 2, 3)


def test_missing_hub_id_is_a_clear_error(fake_cache):
    assert hub_cache_path("nobody/nothing") is None
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        resolve("nobody/nothing")


def test_alias_paths_exist():
    assert os.path.isfile(os.path.join(resolve("minilm"), "config.json"))
    assert resolve("smollm2").endswith(".gguf")


def test_spectrum_command_reports_albert_groups(fake_cache, tmp_path, capsys):
    out = tmp_path / "spec"
    assert main(["spectrum", "tiny-org/tiny-albert", "--out", str(out)]) == 0
    doc = json.loads((out / "spectrum.json").read_text())
    assert [l["group"] for l in doc["layers"]] == [0, 0, 1, 1]
    assert doc["model"]["schedule"] == [0, 1, 0, 1, 2, 3]
    model = load("tiny-org/tiny-albert")
    from powerlens._src.dynamics.params import layer_matrices
    F = np.asarray(layer_matrices(model.layers), np.float64)
    for l, entry in enumerate(doc["layers"]):
        ev = np.linalg.eigvals(F[l])
        top = ev[np.argmax(np.abs(1 + ev))]
        assert entry["eigenvalues_shifted"][0][0] == pytest.approx(top.real, rel=1e-6, abs=1e-9)
        assert abs(entry["eigenvalues_shifted"][0][1]) == pytest.approx(abs(top.imag), rel=1e-6, abs=1e-9)
    assert (out / "eigenvalues.png").stat().st_size > 5000
