"""gpt2 converter (to be written)."""
