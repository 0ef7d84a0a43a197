"""The agent layer: agents and their tables, the model vocabulary, digests, estimates."""
