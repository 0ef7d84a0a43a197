"""Surfaces over HTTP and MCP: the API server, the console's assets, tokens."""
