"""Text -> initial tokens x0, exactly as the model embeds them.

    x0 = word[ids] (+ position[pos]) (+ token_type[0]) -> (embedding LayerNorm) -> (projection)

which covers BERT/RoBERTa/DistilBERT/ALBERT (LayerNorm; ALBERT's E -> d projection),
GPT-2/GPT-Neo (word + position), Llama (word only) and Gemma (word * sqrt(d), the factor
``info.embed_scale`` rounded to float32 and then cast to the model's dtype, as
transformers' ``ScaledWordEmbedding`` does). Prompts are right-padded;
``valid`` is False on padding. A prompt longer than the model's position table is an
error (never silently truncated); an empty prompt is an error.
"""
from __future__ import annotations

import functools
import os
from typing import List, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from ..dynamics.norms import layer_norm
from .base import Model
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


def folder_tokenizer(folder: str) -> Optional[FolderTokenizer]:
    """The :class:`FolderTokenizer` of ``folder``, or None when the folder needs transformers:
    no ``tokenizer.json``, a file ``tokenizers`` cannot read, or added tokens in
    ``tokenizer_config.json`` that the file lacks (transformers would add them)."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer
    try:
        backend = Tokenizer.from_file(path)
        config = _json_or_empty(os.path.join(folder, "tokenizer_config.json"))
        special_map = _json_or_empty(os.path.join(folder, "special_tokens_map.json"))
    except Exception:  # noqa: BLE001  (a file this tokenizers cannot read, or bad JSON: transformers decides)
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


@functools.lru_cache(maxsize=8)
def _tokenizer_for(path: str):
    """The tokenizer of a GGUF file, or of a folder: its ``tokenizer.json`` through
    ``tokenizers`` (:func:`folder_tokenizer`), else transformers' ``AutoTokenizer``."""
    if path.endswith(".gguf"):
        from .gguf_tokenizer import gguf_tokenizer
        return gguf_tokenizer(path)
    tok = folder_tokenizer(path)
    if tok is not None:
        return tok
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def tokenizer(model: Model):
    """The checkpoint's own tokenizer: a folder's ``tokenizer.json`` run by ``tokenizers``
    (:class:`FolderTokenizer`; transformers' ``AutoTokenizer`` for a folder without one),
    or the GGUF file's. ``tok(text)["input_ids"]`` and ``tok.decode(ids)`` on each."""
    if model.info is None or model.info.tokenizer is None:
        raise CheckpointError(f"model {getattr(model.info, 'name', '?')!r} has no tokenizer, so text prompts cannot be "
                              f"embedded: pass token ids (powerlens.embed_ids), or point MODEL at a folder with "
                              f"tokenizer files (tokenizer.json, vocab.txt, ...) or a GGUF file with a vocabulary")
    return _tokenizer_for(model.info.tokenizer)


def tokenize(model: Model, texts: Sequence[str]) -> List[List[int]]:
    """One list of token ids (int) per text, with the special tokens the model's tokenizer
    adds ([CLS] ... [SEP] for BERT, BOS for Llama); never truncated, never padded."""
    if isinstance(texts, str):
        texts = [texts]
    if not texts:
        raise ValueError("no prompts given")
    tok = tokenizer(model)
    out = []
    for i, t in enumerate(texts):
        if not isinstance(t, str) or not t.strip():
            raise ValueError(f"prompt {i} is empty")
        out.append(list(tok(t)["input_ids"]))
    return out


def pad_ids(ids: Sequence[Sequence[int]], pad_id: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Right-pad token id lists: ids (B, n) int32, valid (B, n) bool."""
    if not len(ids):
        raise ValueError("no prompts given")
    for i, row in enumerate(ids):
        if len(row) == 0:
            raise ValueError(f"prompt {i} is empty (no tokens)")
    n = max(len(r) for r in ids)
    arr = np.full((len(ids), n), pad_id, np.int32)
    valid = np.zeros((len(ids), n), bool)
    for i, row in enumerate(ids):
        arr[i, : len(row)] = row
        valid[i, : len(row)] = True
    return arr, valid


def embed_ids(model: Model, ids, valid=None):
    """x0 (B, n, d) for token ids (B, n) (right-padded; ``valid`` (B, n) bool)."""
    ids = np.asarray(ids)
    if ids.ndim == 1:
        ids = ids[None]
    if valid is None:
        valid = np.ones(ids.shape, bool)
    valid = np.asarray(valid, bool).reshape(ids.shape)
    E = model.embeddings
    vocab = E["word"].shape[0]
    if ids.size == 0 or ids.shape[1] == 0:
        raise ValueError("empty prompt: no tokens to embed")
    bad = ids[valid]
    if bad.size and (bad.min() < 0 or bad.max() >= vocab):
        raise ValueError(f"token id out of range [0, {vocab}) in the prompt")
    info = model.info
    n = ids.shape[1]
    if info is not None and info.max_positions is not None and n + info.position_offset > info.max_positions:
        raise ValueError(
            f"prompt of {n} tokens is longer than the model's {info.max_positions - info.position_offset} "
            f"positions ({info.family}); shorten it (powerlens does not truncate silently)")
    pos = None
    if "position" in E:
        if info is not None and info.position_offset:
            # RoBERTa: positions count valid tokens from padding_idx + 1
            pos = np.cumsum(valid, axis=1) * valid + (info.position_offset - 1)
        else:
            pos = np.broadcast_to(np.arange(n), ids.shape)
        pos = np.asarray(pos, np.int32)
    scale = None if info is None or info.embed_scale is None else np.float32(info.embed_scale)
    x = _embed_arrays({k: jnp.asarray(v) for k, v in E.items()}, np.asarray(np.where(valid, ids, 0), np.int32), pos,
                      scale, eps=float(model.layers.config.norm_eps))
    return x, jnp.asarray(valid)


@functools.partial(jax.jit, static_argnames=("eps",))
def _embed_arrays(E: dict, ids: "int[B n]", pos: "int[B n] | None", scale: "float[] | None", *, eps: float):
    """x0 "float[B n d]": word (times ``scale``) + position + token type embeddings, then the
    embedding LayerNorm and projection where the model has them; one compiled program."""
    x = E["word"][ids]
    if scale is not None:
        x = x * scale.astype(x.dtype)
    if pos is not None:
        x = x + E["position"][pos]
    if "token_type" in E:
        x = x + E["token_type"][0]
    if "norm_scale" in E:
        x = layer_norm(x, E["norm_scale"], E.get("norm_bias"), eps)
    if "project_W" in E:
        x = x @ E["project_W"].T + E["project_b"]
    return x


def prompt_ids(model: Model, texts_or_ids) -> List[List[int]]:
    """Token id lists of texts (tokenized) or of token ids (as they are; an array is one prompt per row)."""
    if isinstance(texts_or_ids, str) or (len(texts_or_ids) and isinstance(texts_or_ids[0], str)):
        return [list(r) for r in tokenize(model, texts_or_ids)]
    rows = np.atleast_2d(texts_or_ids) if isinstance(texts_or_ids, np.ndarray) else texts_or_ids
    return [list(np.asarray(r).reshape(-1)) for r in rows]


def padded_ids(model: Model, ids: Sequence[Sequence[int]]) -> Tuple[np.ndarray, np.ndarray]:
    """:func:`pad_ids` with the model's own pad token (0 when it has none)."""
    pad = model.info.pad_token_id if model.info is not None and model.info.pad_token_id is not None else 0
    return pad_ids(ids, pad)


def embed(model: Model, texts_or_ids: Union[str, Sequence[str], Sequence[Sequence[int]], np.ndarray]):
    """x0 (B, n, d) and the padding mask ``valid`` (B, n) for texts or token ids."""
    return embed_ids(model, *padded_ids(model, prompt_ids(model, texts_or_ids)))
