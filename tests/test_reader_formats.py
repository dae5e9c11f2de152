"""Checkpoint storage formats: sharded safetensors, pytorch_model.bin (torch only), and the
clear error when torch is absent."""
from __future__ import annotations

import builtins

import numpy as np
import pytest

from hf_tiny import build
from powerlens._src.dynamics.params import layer_matrices
from powerlens._src.models import load
from powerlens._src.models.reader import CheckpointError


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("single")
    model = build("bert", folder, seed=4)
    return model, np.asarray(layer_matrices(load(str(folder)).layers))


def test_sharded_safetensors(tmp_path, reference):
    model, F = reference
    model.save_pretrained(str(tmp_path), max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    np.testing.assert_array_equal(np.asarray(layer_matrices(load(str(tmp_path)).layers)), F)


def save_bin(model, folder):
    """A legacy checkpoint: config.json + pytorch_model.bin (transformers 5 writes safetensors only)."""
    import torch
    model.config.save_pretrained(str(folder))
    torch.save(model.state_dict(), str(folder / "pytorch_model.bin"))


def test_pytorch_bin_with_torch(tmp_path, reference):
    model, F = reference
    save_bin(model, tmp_path)
    assert (tmp_path / "pytorch_model.bin").exists() and not (tmp_path / "model.safetensors").exists()
    np.testing.assert_array_equal(np.asarray(layer_matrices(load(str(tmp_path)).layers)), F)


def test_pytorch_bin_without_torch_is_a_clear_error(tmp_path, reference, monkeypatch):
    model, _ = reference
    save_bin(model, tmp_path)
    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("No module named 'torch'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    with pytest.raises(CheckpointError, match="pytorch_model.bin, which needs torch"):
        load(str(tmp_path))
