"""The chaos harness (kill matrix); see README.md beside this file."""
