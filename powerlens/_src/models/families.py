"""Import every family module so that its converter registers itself, with its config
allow-list and its output-projection layout (``@register`` in :mod:`powerlens._src.models.base`)."""
from . import albert, bert, gpt2, gpt_neo, llama, mistral_qwen  # noqa: F401
from . import gpt_neox, opt, phi  # noqa: F401  (GPT-NeoX/Pythia, OPT, Phi and Phi-3)
from . import gemma, qwen3  # noqa: F401  (Gemma 1/2/3, Qwen3)
