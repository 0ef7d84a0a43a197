"""Surfaces over HTTP and MCP: the API server, the console's assets, tokens."""

# Where the API listens unless told: here, so that the CLI describes its options without
# importing the server (aiohttp).
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8420
MOST_PROCESSES = 64
"""Most API server processes ``--workers`` may ask for (each holds its own database pool)."""
