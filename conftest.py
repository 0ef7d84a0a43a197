"""pytest settings for the whole checkout (tests, chaos, examples) that need an optional plugin.

Each test gets 300 s where pytest-timeout is installed (Toren's test dependencies bring it),
unless ``--timeout``, ``PYTEST_TIMEOUT``, a ``timeout`` ini value (``-o timeout=N``) or a
``timeout`` mark says otherwise. It is not a ``timeout`` key in pyproject.toml: without the
plugin pytest refuses an unknown key (warnings are errors there), and a user who installed only
pytest, as the docs say, could not run the examples' tests. Without the plugin, ``timeout``
marks are registered and do nothing.
"""

from __future__ import annotations

import os

import pytest

TEST_TIMEOUT = 300.0  # seconds; a hung test fails with every thread's stack instead of hanging CI


@pytest.hookimpl(tryfirst=True)  # before pytest-timeout's own pytest_configure reads the option
def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin("timeout"):
        config.addinivalue_line("markers", "timeout(seconds): a limit, with pytest-timeout")
    elif (
        config.getoption("timeout") is None
        and not os.environ.get("PYTEST_TIMEOUT")
        and not config.getini("timeout")  # `-o timeout=N`, or an ini file's own key
    ):
        config.option.timeout = TEST_TIMEOUT
