"""Runnable example apps, each with its README, offline model script and test."""
