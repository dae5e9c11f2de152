"""The command line answers at once, and a model folder is tokenised without transformers.

* Building the parser, ``--help`` of every command and every usage error import none of jax,
  transformers, scipy, torch (each checked in a fresh process).
* The parser's choices, ``--help`` and MODEL's help agree with the library: every command,
  every alias, every attention mode, rule and ordering.
* A folder with a ``tokenizer.json`` is run by ``tokenizers`` directly, with the ids, decoding
  and unknown id of transformers' ``AutoTokenizer``: MiniLM's (WordPiece, [CLS]/[SEP]) and a
  byte-level BPE folder written from SmolLM2's tokenizer, with and without a BOS template.
  ``pl.tokenize`` and ``pl.embed`` give what the transformers ids give; a folder without
  ``tokenizer.json`` still goes through transformers.
* What ``align`` imports: no transformers, no scipy.stats (the binomial p-value is the same
  incomplete beta function, bit for bit), no scipy.linalg.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from cli_probe import probe

HEAVY = ("jax", "transformers", "scipy", "torch")


def _python(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)


def test_building_the_parser_imports_no_numerical_library():
    code = ("import sys; from powerlens.cli import build_parser; build_parser(); "
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    r = _python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


# argv -> the exit status argparse gives (0 for help, 2 for a usage error)
CASES = {
    "--help": 0, "simulate --help": 0, "spectrum --help": 0, "align --help": 0, "steer --help": 0,
    "reproduce --help": 0, "sweep --help": 0,
    "": 2, "bogus": 2, "simulate": 2, "align minilm --bogus": 2, "align": 2, "spectrum --out": 2,
    "steer minilm --out o": 2, "simulate --spectrum 1 --attention bogus --out o": 2, "sweep": 2,
    "reproduce --jobs x": 2,
}


def test_help_and_usage_errors_import_no_numerical_library():
    """One fresh process runs every case in turn and reports, after each, the exit status, the
    last line on stderr and which heavy modules are loaded by then."""
    seen = {argv: (status, lines[-1] if lines else "", heavy)
            for argv, (status, lines, heavy) in probe(list(CASES), HEAVY).items()}
    assert set(seen) == set(CASES)
    for argv, (status, last, heavy) in seen.items():
        assert status == CASES[argv], (argv, status, last)
        assert heavy == [], (argv, heavy)
        if status:
            command = argv.split()[0] if argv and argv.split()[0] != "bogus" else None
            assert last.startswith(f"powerlens {command}: error: " if command else "powerlens: error: "), (argv, last)


def test_help_names_every_command_alias_and_choice():
    from powerlens import cli
    from powerlens._src.analysis.spectra import ORDERS
    from powerlens._src.dynamics import ATTENTION_MODES, RULES
    from powerlens._src.models.load import ALIASES, ASSEMBLED
    assert (cli.ATTENTION_MODES, cli.RULES, cli.ORDERS) == (ATTENTION_MODES, RULES, ORDERS)
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert sorted(commands) == ["align", "reproduce", "simulate", "spectrum", "steer", "sweep"]
    text = parser.format_help()
    assert all(name in text for name in commands)
    aliases = [*ALIASES, *ASSEMBLED]
    assert sorted(aliases) == ["gemma3", "minilm", "smollm2"]
    assert cli.MODEL_HELP.endswith("an alias: " + ", ".join(aliases))
    for name in ("spectrum", "align", "steer"):
        model = next(a for a in commands[name]._actions if a.dest == "model")
        assert model.help == cli.MODEL_HELP
    simulate = {a.dest: a for a in commands["simulate"]._actions}
    assert tuple(simulate["attention"].choices) == ATTENTION_MODES
    assert tuple(simulate["order"].choices) == ORDERS
    assert tuple(simulate["rule"].choices) == tuple(r for r in RULES if r != "full")


# ----------------------------------------------------------------------------- tokenizers

PROMPTS = ["The cat sat on the mat.", "x", "  a  ", " ", ".", "Héllo wörld, ÀÉÎ ç", "日本語のテキストです",
           "Ελληνικά και русский", "emoji 🐱👍🏽 ok", "[CLS] inside [SEP] text [MASK]", "tab\tnew\nline",
           "don't stop-believing!!! 3.14", "\u200bzero\u00a0width", "ﬁ ligature Ⅻ", "<|im_start|>user\nhi<|im_end|>"]


def _compare(ours, ref, prompts=PROMPTS):
    for text in prompts:
        ids = ours(text)["input_ids"]
        assert ids == list(ref(text)["input_ids"]), text
        assert all(type(i) is int for i in ids)
        assert ours.encode(text, add_special_tokens=False) == list(ref.encode(text, add_special_tokens=False)), text
        assert ours.decode(ids) == ref.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text


@pytest.fixture(scope="module")
def minilm():
    from powerlens._src.models import load
    return load("minilm")


def test_minilm_tokenizer_is_tokenizers_with_the_ids_of_transformers(minilm):
    from transformers import AutoTokenizer
    from powerlens._src.models.embed import FolderTokenizer, tokenizer
    ours, ref = tokenizer(minilm), AutoTokenizer.from_pretrained(minilm.info.tokenizer)
    assert isinstance(ours, FolderTokenizer)
    _compare(ours, ref)
    assert ours("The cat sat on the mat.")["input_ids"][0] == 101 and ours("x")["input_ids"][-1] == 102  # [CLS] [SEP]
    assert ours.unk_token_id == ref.unk_token_id == 100
    assert ours.convert_tokens_to_ids(["king", "paris", "nosuchtoken"]) == ref.convert_tokens_to_ids(
        ["king", "paris", "nosuchtoken"])
    for i in range(0, 30522, 499):
        assert ours.decode([i]) == ref.decode([i]), i


def test_tokenize_and_embed_give_what_the_transformers_ids_give(minilm):
    """pl.tokenize's lists and pl.embed's (x0, valid): right padding with the model's pad id
    (0), unicode and short prompts; the file's own padding to 128 and truncation are off."""
    from transformers import AutoTokenizer
    import powerlens as pl
    from powerlens._src.models.embed import padded_ids
    ref = AutoTokenizer.from_pretrained(minilm.info.tokenizer)
    texts = ["x", "Ελληνικά και русский 🐱", "The cat sat on the mat, and then it sat on the dog."]
    ids = pl.tokenize(minilm, texts)
    assert ids == [list(ref(t)["input_ids"]) for t in texts]
    assert [len(r) for r in ids] == [3, len(ids[1]), len(ids[2])] and len(ids[2]) < 128
    x0, valid = pl.embed(minilm, texts)
    ref_x0, ref_valid = pl.embed_ids(minilm, *padded_ids(minilm, [list(ref(t)["input_ids"]) for t in texts]))
    np.testing.assert_array_equal(np.asarray(valid), np.asarray(ref_valid))
    np.testing.assert_array_equal(np.asarray(x0), np.asarray(ref_x0))
    assert np.asarray(valid).sum(1).tolist() == [len(r) for r in ids]
    with pytest.raises(ValueError, match="longer than the model's 512 positions"):
        pl.embed(minilm, ["word " * 600])                 # never cut to the file's 128 or to 512


def test_a_folder_without_tokenizer_json_goes_through_transformers(minilm, tmp_path):
    import importlib
    embed_module = importlib.import_module("powerlens._src.models.embed")     # (powerlens._src.models.embed is the function)
    for f in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(minilm.info.tokenizer, f), tmp_path / f)
    assert embed_module.folder_tokenizer(str(tmp_path)) is None
    tok = embed_module._tokenizer_for(str(tmp_path))
    assert not isinstance(tok, embed_module.FolderTokenizer)
    assert list(tok("The cat sat.")["input_ids"]) == embed_module.tokenizer(minilm)("The cat sat.")["input_ids"]


@pytest.fixture(scope="module")
def smollm2_folder(tmp_path_factory):
    """SmolLM2's tokenizer (from its GGUF file) saved as a Hugging Face folder."""
    from powerlens._src.models import CheckpointError, resolve
    from powerlens._src.models.gguf_tokenizer import gguf_tokenizer
    try:
        path = resolve("smollm2")
    except CheckpointError as exc:
        pytest.skip(f"SmolLM2 GGUF not installed: {exc}")
    gguf_tok = gguf_tokenizer(path)
    folder = tmp_path_factory.mktemp("smollm2_tokenizer")
    gguf_tok.backend.save(str(folder / "tokenizer.json"))
    token = gguf_tok.convert_ids_to_tokens
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "bos_token": token(gguf_tok.bos_token_id), "eos_token": token(gguf_tok.eos_token_id),
              "unk_token": token(gguf_tok.unk_token_id)}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder, gguf_tok


@pytest.mark.parametrize("bos", [False, True])
def test_byte_level_bpe_folder_with_and_without_bos(smollm2_folder, bos):
    """The GGUF tokenizer, the folder through transformers and the folder through tokenizers
    agree; with a BOS template in tokenizer.json (as Llama folders have) every prompt starts
    with BOS in both, whatever tokenizer_config.json's add_bos_token says."""
    from transformers import AutoTokenizer
    from powerlens._src.models.embed import FolderTokenizer, folder_tokenizer
    folder, gguf_tok = smollm2_folder
    if bos:
        folder = folder.parent / "with_bos"
        shutil.copytree(smollm2_folder[0], folder, dirs_exist_ok=True)
        doc = json.loads((folder / "tokenizer.json").read_text())
        bos_token = "<|im_start|>"
        bos_id = gguf_tok.convert_tokens_to_ids(bos_token)
        doc["post_processor"] = {"type": "TemplateProcessing",
                                 "single": [{"SpecialToken": {"id": bos_token, "type_id": 0}},
                                            {"Sequence": {"id": "A", "type_id": 0}}],
                                 "pair": [{"SpecialToken": {"id": bos_token, "type_id": 0}},
                                          {"Sequence": {"id": "A", "type_id": 0}},
                                          {"Sequence": {"id": "B", "type_id": 1}}],
                                 "special_tokens": {bos_token: {"id": bos_token, "ids": [bos_id],
                                                                "tokens": [bos_token]}}}
        (folder / "tokenizer.json").write_text(json.dumps(doc))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, add_bos_token=False)))
    ours, ref = folder_tokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder))
    assert isinstance(ours, FolderTokenizer)
    _compare(ours, ref)
    for text in PROMPTS:
        ids = ours(text)["input_ids"]
        plain = list(gguf_tok(text)["input_ids"])
        assert ids == ([bos_id] + plain if bos else plain), text


def test_align_imports_no_transformers_and_no_scipy_stats(tmp_path):
    """The modules ``powerlens align minilm`` needs, and MiniLM's tokenizer, in a fresh process."""
    code = ("import sys\nimport powerlens._src.commands.models\nfrom powerlens._src.models import load, tokenize\n"
            "print(tokenize(load('minilm'), ['The cat sat.']))\n"
            "print(sorted(m for m in ('transformers', 'torch', 'scipy.stats', 'scipy.linalg', 'pandas', 'pyarrow', "
            "'tqdm', 'optax') if m in sys.modules))")
    r = _python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[[101, 1996, 4937, 2938, 1012, 102]]", "[]"]


def test_binomial_pvalue_is_scipy_stats_binom_sf_bit_for_bit():
    from scipy import stats
    from powerlens._src.analysis.measures import binomial_pvalue
    for n in (1, 2, 9, 40, 1000, 65536):
        k = np.arange(-2, n + 3)
        for p in (0.5, 0.1, 0.0, 1.0):
            np.testing.assert_array_equal(binomial_pvalue(k, n, p), stats.binom.sf(k - 1, n, p))
    assert binomial_pvalue(7, 9) == float(stats.binom.sf(6, 9, 0.5)) and isinstance(binomial_pvalue(7, 9), float)
    assert np.isnan(binomial_pvalue([1, 2], 0)).all()


_SMALL_PROGRAM = """
import os
from powerlens.cli import _compilation_cache
folder = _compilation_cache()
import jax, jax.numpy as jnp
jax.block_until_ready(jax.jit(lambda x: x * 2 + 1)(jnp.ones(3)))
print(len([f for f in os.listdir(folder) if f.endswith("-cache")]))
"""


def test_the_compilation_cache_keeps_small_programs(tmp_path):
    """A program that compiles in a few ms gets its entry too (a short command compiles
    mostly such programs), with no JAX setting from outside."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "POWERLENS_XLA_CACHE"}
    env["POWERLENS_CACHE"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", _SMALL_PROGRAM], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[-1]) >= 1


def test_startup_benchmark_counts_top_level_imports_once():
    """benchmarks/startup.py sums the cumulative times of the top-level imports only (a nested
    import is inside its parent's), and measures a real `powerlens --help` process."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import startup
    text = ("import time: self [us] | cumulative | imported package\n"
            "import time:       100 |        100 |     child\n"
            "import time:       200 |        300 |   parent\n"
            "import time:        50 |        350 | top\n"
            "import time:        10 |         10 | other\n"
            "some other line\n")
    assert startup.import_seconds(text) == pytest.approx(360e-6)
    res = startup.measure(["--help"], "none", repeat=1, text="x")
    assert 0 < res["imports"] and 0 < res["share"] <= 1 and res["wall"] > 0
