"""Structured outputs: grammar-constrained decoding (llguidance) and tool calling."""
