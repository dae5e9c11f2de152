"""llama converter (to be written)."""
