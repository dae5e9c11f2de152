"""Checkpoint readers: Hugging Face folders, the local HF cache and GGUF files.

    model = load("minilm")                      # or a folder, a hub id in the cache, a .gguf
    x0, valid = embed(model, ["a sentence"])    # the model's own tokenizer and embeddings
"""
from .base import Model, ModelInfo
from .load import ALIASES, load, resolve
from .reader import CheckpointError, TensorReader
from .embed import embed, embed_ids, tokenize
from .forward import hidden_states, logits, run_states
