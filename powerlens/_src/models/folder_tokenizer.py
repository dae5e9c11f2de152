"""A Hugging Face folder's ``tokenizer.json``, run by ``tokenizers`` itself (no transformers):
:class:`FolderTokenizer` and :func:`folder_tokenizer`, which builds one or says why it cannot.
The GGUF tokenizer (:mod:`~powerlens._src.models.gguf_tokenizer`) is a :class:`FolderTokenizer`
built from the file's metadata; :mod:`~powerlens._src.models.embed` picks between them.
"""
from __future__ import annotations

import os
from typing import List, Optional

import numpy as np

from .reader import CheckpointError


class FolderTokenizer:
    """A Hugging Face folder's ``tokenizer.json``, run by ``tokenizers`` itself (no transformers).

    The ids are those of transformers' ``AutoTokenizer`` on the same folder, which also starts
    from ``tokenizer.json``; what it changes there is done here too:

    * the truncation and padding stored in the file are switched off: a prompt is never cut
      (one longer than the model's positions is an error in :func:`embed_ids`), and
      :func:`pad_ids` right-pads with the model's own pad id;
    * the special tokens are those the file's post-processor adds (``[CLS] $A [SEP]`` for
      BERT, BOS for Llama): with a ``tokenizer.json``, transformers too ignores the
      ``add_bos_token`` / ``add_eos_token`` of ``tokenizer_config.json``;
    * ``decode`` keeps special tokens unless told otherwise, and applies the
      ``clean_up_tokenization_spaces`` of ``tokenizer_config.json`` (never to BPE).

    ``tok(text)["input_ids"]`` and ``tok.encode(text, add_special_tokens=True)`` give the ids
    (a list of int); ``tok.decode(ids)``, ``tok.unk_token_id`` and ``tok.convert_tokens_to_ids``
    as in transformers. :func:`folder_tokenizer` builds one, or says why it cannot.
    """

    def __init__(self, backend, *, unk_token_id: Optional[int] = None, clean_up_spaces: bool = False):
        self.backend = backend
        self.unk_token_id = unk_token_id
        self.clean_up_spaces = clean_up_spaces and type(backend.model).__name__ != "BPE"

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        text = self.backend.decode([int(i) for i in np.atleast_1d(ids)], skip_special_tokens=skip_special_tokens)
        if self.clean_up_spaces:
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            i = self.backend.token_to_id(tokens)
            return self.unk_token_id if i is None else i
        return [self.convert_tokens_to_ids(t) for t in tokens]


def _special_token(name: str, config: dict, special_map: dict) -> Optional[str]:
    """The text of special token ``name`` (bos_token, ...) in tokenizer_config.json or
    special_tokens_map.json (a string, or a dict with its ``content``)."""
    value = config.get(name, special_map.get(name))
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _json_or_empty(path: str) -> dict:
    import json
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        doc = json.load(fh)
    return doc if isinstance(doc, dict) else {}


def tokenizer_json_error(path: str) -> Optional[str]:
    """Why the file ``path`` cannot be a ``tokenizer.json`` (one line, naming the file), or None:
    unreadable, empty, not UTF-8, not JSON (its line and column), nested too deeply to parse,
    not a JSON object, or a negative token id in ``model.vocab`` or ``added_tokens`` (ids index
    the embedding rows). Run when ``tokenizers`` refuses the file, to say why."""
    import json
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        return f"{path}: cannot read the tokenizer file ({exc.strerror})"
    if not data.strip():
        return f"{path}: the tokenizer file is empty; expected a JSON object (a tokenizers tokenizer.json)"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        return f"{path}: the tokenizer file is not UTF-8 text (byte 0x{data[exc.start]:02x} at line {line})"
    try:
        doc = json.loads(text)
    except RecursionError:
        return f"{path}: the tokenizer file is nested too deeply to be a tokenizer.json"
    except json.JSONDecodeError as exc:
        return f"{path}: the tokenizer file is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
    if not isinstance(doc, dict):
        return f"{path}: the tokenizer file holds a JSON {type(doc).__name__}, not an object"
    model = doc.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    ids = [(t, i) for t, i in vocab.items()] if isinstance(vocab, dict) else []
    ids += [(a.get("content"), a.get("id")) for a in doc.get("added_tokens") or [] if isinstance(a, dict)]
    for token, i in ids:
        if isinstance(i, int) and not isinstance(i, bool) and i < 0:
            return f"{path}: token {str(token)[:40]!r} has the negative id {i}; token ids count from 0"
    return None


def folder_tokenizer(folder: str) -> Optional[FolderTokenizer]:
    """The :class:`FolderTokenizer` of ``folder``, or None when the folder needs transformers:
    no ``tokenizer.json``, a file ``tokenizers`` cannot read although it is well-formed JSON
    (a newer format: transformers decides), or added tokens in ``tokenizer_config.json`` that
    the file lacks (transformers would add them). A ``tokenizer.json`` that is no tokenizer file
    at all (:func:`tokenizer_json_error`) is a :class:`CheckpointError` naming it."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer
    try:
        backend = Tokenizer.from_file(path)
    except Exception:  # noqa: BLE001  (a file this tokenizers cannot read: say why, or transformers decides)
        why = tokenizer_json_error(path)
        if why is not None:
            raise CheckpointError(why) from None
        return None
    try:
        config = _json_or_empty(os.path.join(folder, "tokenizer_config.json"))
        special_map = _json_or_empty(os.path.join(folder, "special_tokens_map.json"))
    except Exception:  # noqa: BLE001  (bad JSON: transformers decides)
        return None
    for i, token in (config.get("added_tokens_decoder") or {}).items():
        content = token.get("content") if isinstance(token, dict) else None
        if not str(i).isdigit() or content is None or backend.token_to_id(content) != int(i):
            return None
    backend.no_truncation()
    backend.no_padding()
    unk = _special_token("unk_token", config, special_map) or getattr(backend.model, "unk_token", None)
    unk_id = None if unk is None else backend.token_to_id(unk)
    return FolderTokenizer(backend, unk_token_id=unk_id,
                           clean_up_spaces=config.get("clean_up_tokenization_spaces") is True)
