"""Import every family module so that its converter registers itself, with its config
allow-list and its output-projection layout (``@register`` in :mod:`powerlens.models.base`)."""
from . import albert, bert, gpt2, gpt_neo, llama, mistral_qwen  # noqa: F401
