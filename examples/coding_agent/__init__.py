"""A coding agent that writes and runs code in its own sandbox container."""
