"""Import every family module so that its converter registers itself."""
from . import albert, bert, gpt2, gpt_neo, llama  # noqa: F401
