"""The package version; one place, read by hatchling and by the worker registry."""

__version__ = "0.1.0"
