"""gpt_neo converter (to be written)."""
