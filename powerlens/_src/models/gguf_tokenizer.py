"""The tokenizer a GGUF file describes, built with ``tokenizers`` from the file's own metadata.

A GGUF file has no ``tokenizer.json``: it stores the vocabulary and how to use it under
llama.cpp's keys. This module reads them once (:func:`tokenizer_spec`, from the already
parsed file) and builds a ``tokenizers.Tokenizer``, run directly (:class:`GGUFTokenizer`,
:func:`build_tokenizer`) -- no transformers, no torch, no second parse of the file. The
construction is the one transformers' own GGUF integration makes (the test suite checks the
ids and the decoding against it on a few hundred strings).

Keys read (``tokenizer.ggml.*``)::

    model            "gpt2"  byte-level BPE with merges (SmolLM2, Llama 3, Qwen, ...)
                     "llama" SentencePiece-style BPE: the "▁" space marker, byte fallback
                             (<0xXX> tokens), merges from the file or, when it has none,
                             recovered from the vocabulary ordered by the scores
    pre              pre-tokenizer name: picks the split regex of byte-level BPE
    tokens           the vocabulary, in id order
    scores           SentencePiece scores (only used to recover merges)
    token_type       1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte:
                     control tokens become special tokens, user-defined ones added tokens,
                     so that both are matched whole in the text
    merges           "left right" pairs, best first
    bos/eos/unknown/padding_token_id, add_bos_token, add_eos_token, add_space_prefix

Gemma files (architecture ``gemma*`` with model ``llama``) spell runs of spaces with real
spaces, list no merges, and order their merges by position rather than by score; they get
the Gemma variant (:func:`_gemma_backend`). Any other tokenizer model is a CheckpointError
naming the model and the file.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Dict, List, Optional, Tuple

from ..io import cache_dir
from .folder_tokenizer import FolderTokenizer
from .reader import CheckpointError

TOKENIZER_MODELS = ("gpt2", "llama")
CONTROL, USER_DEFINED = 3, 4

# byte-level BPE: the split regex of each ``tokenizer.ggml.pre`` value that is not GPT-2's own
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """What a GGUF file says about its tokenizer (plain Python data, read once)."""

    path: str
    architecture: str
    model: str
    pre: Optional[str]
    tokens: Tuple[str, ...]
    scores: Optional[Tuple[float, ...]]
    token_type: Optional[Tuple[int, ...]]
    merges: Optional[Tuple[str, ...]]
    special_ids: Dict[str, Optional[int]]        # bos/eos/unk/pad -> id
    add_bos: bool
    add_eos: bool
    add_space_prefix: Optional[bool]

    def token(self, key: str) -> Optional[str]:
        i = self.special_ids.get(key)
        if i is None:
            return None
        if not 0 <= i < len(self.tokens):
            raise CheckpointError(f"{self.path}: tokenizer.ggml.{_ID_KEYS[key]}={i} is outside the "
                                  f"vocabulary of {len(self.tokens)} tokens")
        return self.tokens[i]


_ID_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}


def tokenizer_spec(gguf) -> TokenizerSpec:
    """Read the tokenizer keys of a parsed GGUF file (``GGUFFile``: ``.path``, ``.meta(key)``)."""
    meta = lambda key, default=None: gguf.meta(f"tokenizer.ggml.{key}", default)
    path = gguf.path
    model = meta("model")
    if model is None:
        raise CheckpointError(f"{path}: the GGUF file has no tokenizer (key tokenizer.ggml.model is missing); "
                              f"pass token ids instead of text")
    if model not in TOKENIZER_MODELS:
        raise CheckpointError(f"{path}: unsupported GGUF tokenizer model tokenizer.ggml.model={model!r} "
                              f"(supported: {', '.join(TOKENIZER_MODELS)})")
    tokens = meta("tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens is missing or not a list of strings")
    opt = lambda key, kind: None if meta(key) is None else tuple(kind(v) for v in meta(key))
    spec = TokenizerSpec(
        path=path, architecture=str(gguf.meta("general.architecture", "")), model=model, pre=meta("pre"),
        tokens=tuple(tokens), scores=opt("scores", float), token_type=opt("token_type", int),
        merges=opt("merges", str),
        special_ids={k: (None if meta(v) is None else int(meta(v))) for k, v in _ID_KEYS.items()},
        # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise
        add_bos=bool(meta("add_bos_token", model == "llama")), add_eos=bool(meta("add_eos_token", False)),
        add_space_prefix=meta("add_space_prefix"))
    for name in ("scores", "token_type"):
        v = getattr(spec, name)
        if v is not None and len(v) != len(spec.tokens):
            raise CheckpointError(f"{path}: tokenizer.ggml.{name} has {len(v)} entries for "
                                  f"{len(spec.tokens)} tokens")
    for key in _ID_KEYS:
        spec.token(key)                      # validates the ids
    return spec


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> Dict[int, str]:
    """GPT-2's reversible byte -> printable character map (``bytes_to_unicode``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _merge_pairs(spec: TokenizerSpec) -> List[Tuple[str, str]]:
    out = [tuple(m.split(" ", 1)) for m in spec.merges]
    for i, pair in enumerate(out):
        if len(pair) != 2 or not pair[0] or not pair[1]:
            raise CheckpointError(f"{spec.path}: tokenizer.ggml.merges[{i}]={spec.merges[i]!r} "
                                  f"is not a 'left right' pair")
    return out


def _recovered_merges(vocab: Dict[str, int], order: Dict[str, float]) -> List[Tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    best (highest ``order``) token first; ties by the lengths of the parts."""
    merges = []
    for piece, score in order.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _byte_level_backend(spec: TokenizerSpec):
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    spelled = re.compile("[" + re.escape("".join(sorted(letters))) + "]*").fullmatch
    # a token already written in the byte alphabet is kept; any other is respelled byte by byte
    vocab = {(t if spelled(t) else "".join(alphabet[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(spec.tokens)}
    merges = _merge_pairs(spec) if spec.merges is not None else []
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(spec.pre)
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, letters


def _sentencepiece_backend(spec: TokenizerSpec):
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    vocab = {t: i for i, t in enumerate(spec.tokens)}
    if spec.merges is not None:
        merges = _merge_pairs(spec)
    elif spec.scores is not None:
        merges = _recovered_merges(vocab, dict(zip(spec.tokens, spec.scores)))
    else:
        raise CheckpointError(f"{spec.path}: a 'llama' tokenizer needs tokenizer.ggml.merges or .scores")
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    prefix = spec.add_space_prefix is not False             # llama.cpp's default is to add it
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                 split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok, None


def _gemma_backend(spec: TokenizerSpec):
    """Gemma: runs of spaces are stored as spaces (respelled "▁"), merges ordered by position."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in spec.tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if spec.merges is not None:
        merges = _merge_pairs(spec)
    else:
        merges = _recovered_merges(vocab, {t: -i for i, t in enumerate(tokens)})
    unk = spec.token("unk") or "<unk>"
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token=unk, dropout=None, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.normalizer = normalizers.Replace(" ", "▁")
    return tok, None


def _backend(spec: TokenizerSpec):
    if spec.model == "gpt2":
        return _byte_level_backend(spec)
    recovered = spec.merges is None
    path = _cache_path(spec) if recovered and len(spec.tokens) >= CACHE_MIN_TOKENS else None
    if path is not None and os.path.isfile(path):
        from tokenizers import Tokenizer
        try:
            return Tokenizer.from_file(path), None
        except Exception:  # noqa: BLE001  (a damaged cache entry is rebuilt)
            pass
    tok, letters = _gemma_backend(spec) if spec.architecture.startswith("gemma") else _sentencepiece_backend(spec)
    if path is not None:
        from .. import io
        try:
            io.write_text(path, tok.to_str())
        except OSError:
            pass                     # a read-only cache: build it again next time
    return tok, letters


CACHE_MIN_TOKENS = 32768
"""Vocabularies without stored merges at least this large keep their built tokenizer in
:func:`cache_dir` (recovering Gemma 3's merges from 262,144 tokens takes about 5 s)."""

CACHE_VERSION = 1
"""Bumped whenever the construction of a tokenizer changes, so that no stale one is read."""


def _cache_path(spec: TokenizerSpec) -> Optional[str]:
    """The cache file of the tokenizer built from ``spec``: named by the GGUF file (its real
    path, size and modification time), :data:`CACHE_VERSION` and the ``tokenizers`` version."""
    import hashlib

    import tokenizers
    try:
        key = (*_file_key(spec.path), CACHE_VERSION, tokenizers.__version__)
    except OSError:
        return None
    name = hashlib.sha256(repr(key).encode()).hexdigest()[:24]
    return os.path.join(cache_dir(), "tokenizers", f"{name}.json")


class GGUFTokenizer(FolderTokenizer):
    """The tokenizer of a GGUF file: a ``tokenizers.Tokenizer`` run directly, as a folder's
    ``tokenizer.json`` is (:class:`~powerlens._src.models.folder_tokenizer.FolderTokenizer`: ``tok(text)``,
    ``encode``, ``decode``, ``convert_tokens_to_ids``, ``unk_token_id``), with the file's
    ``bos_token_id`` / ``eos_token_id`` (None where it names none) and ``convert_ids_to_tokens``."""

    def __init__(self, backend, *, unk_token_id: Optional[int] = None, bos_token_id: Optional[int] = None,
                 eos_token_id: Optional[int] = None):
        super().__init__(backend, unk_token_id=unk_token_id)
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id

    def convert_ids_to_tokens(self, ids):
        """The token of an id, or the list of tokens of a list of ids."""
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(int(i)) for i in ids]


def _bos_eos_template(bos: Optional[Tuple[str, int]], eos: Optional[Tuple[str, int]]):
    """The post-processor that puts BOS before and EOS after a prompt, (token, id) each or
    None: ``BOS $A EOS``, and ``BOS $A EOS BOS $B EOS`` for a pair (type ids 0 and 1), the
    template transformers' ``PreTrainedTokenizerFast`` writes for ``add_bos_token``/``add_eos_token``."""
    from tokenizers import processors

    def sequence(name: str, type_id: int) -> str:
        parts = [bos and bos[0], f"${name}", eos and eos[0]]
        return " ".join(f"{p}:{type_id}" for p in parts if p)

    return processors.TemplateProcessing(single=sequence("A", 0), pair=f"{sequence('A', 0)} {sequence('B', 1)}",
                                         special_tokens=[t for t in (bos, eos) if t is not None])


def build_tokenizer(spec: TokenizerSpec) -> GGUFTokenizer:
    """The :class:`GGUFTokenizer` of a :class:`TokenizerSpec` (``tokenizers`` only).

    ``tok(text)["input_ids"]`` adds BOS/EOS as the file's ``add_bos_token``/``add_eos_token`` say;
    the named tokens (bos/eos/unk/pad) and the control tokens are special (kept whole in the
    text, dropped by ``decode(ids, skip_special_tokens=True)``), user-defined tokens are added
    tokens (kept whole). The backend is the one transformers' ``PreTrainedTokenizerFast`` makes
    of the same construction, token for token (the tests compare the ids and the decoding with
    transformers' own GGUF tokenizer): no truncation, no padding, no clean-up of spaces.
    """
    from tokenizers import AddedToken

    backend, letters = _backend(spec)
    backend.no_truncation()
    backend.no_padding()
    names = {k: spec.token(k) for k in _ID_KEYS}
    present = {str(t) for t in backend.get_added_tokens_decoder().values()}
    named = [AddedToken(t, special=True) for t in dict.fromkeys(names[k] for k in ("bos", "eos", "unk", "pad"))
             if t is not None and t not in present]
    if named:
        backend.add_tokens(named)
    types = spec.token_type or ()
    # in a byte-level vocabulary a control token outside the byte alphabet is a llama.cpp mislabel
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(spec.tokens, types)
               if k == CONTROL and (letters is None or set(t) <= letters)]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab(with_added_tokens=True)
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(spec.tokens, types)
            if k == USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens(user)
    ids = {k: None if t is None else backend.token_to_id(t) for k, t in names.items()}
    with_id = lambda k: None if ids[k] is None else (names[k], ids[k])
    backend.post_processor = _bos_eos_template(with_id("bos") if spec.add_bos else None,
                                               with_id("eos") if spec.add_eos else None)
    return GGUFTokenizer(backend, unk_token_id=ids["unk"], bos_token_id=ids["bos"], eos_token_id=ids["eos"])


# specs read while loading a model, so that its tokenizer never parses the file again
_SPECS: Dict[Tuple[str, int, int], object] = {}


def _file_key(path: str):
    st = os.stat(path)
    return os.path.realpath(path), st.st_mtime_ns, st.st_size


def remember_tokenizer(gguf) -> bool:
    """Read and keep the tokenizer spec of a GGUF file being loaded (or the CheckpointError that
    reading it raised, to be raised when the tokenizer is asked for), so that
    :func:`gguf_tokenizer` never parses the file again. False when the file has no tokenizer."""
    if gguf.meta("tokenizer.ggml.model") is None:
        return False
    try:
        spec = tokenizer_spec(gguf)
    except CheckpointError as exc:
        spec = exc
    if len(_SPECS) >= 8:
        _SPECS.pop(next(iter(_SPECS)))
    _SPECS[_file_key(gguf.path)] = spec
    return True


def gguf_tokenizer(path: str, gguf=None):
    """The tokenizer stored in the GGUF file ``path``.

    Uses the spec remembered when the model was loaded from that (unchanged) file; else reads
    it from ``gguf`` (a parsed ``GGUFFile``) or, failing both, parses the file.
    """
    spec = _SPECS.get(_file_key(path))
    if spec is None:
        if gguf is None:
            from .gguf_file import GGUFFile
            gguf = GGUFFile(path)
        spec = tokenizer_spec(gguf)
    if isinstance(spec, CheckpointError):
        raise spec
    try:
        return build_tokenizer(spec)
    except CheckpointError:
        raise
    except Exception as exc:   # tokenizers raises plain Exceptions on an inconsistent vocabulary
        raise CheckpointError(f"{path}: cannot build the tokenizer from the GGUF metadata "
                              f"({type(exc).__name__}: {exc})") from exc

