"""Old names kept so that code written against them runs unchanged."""

from __future__ import annotations

import subprocess
import sys


def test_toren_sandbox_is_toren_sandboxes_under_its_old_name() -> None:
    # In a fresh interpreter: which name is imported first must not matter.
    code = (
        "from toren.sandbox import Sandbox\n"
        "import toren.sandbox.files as old_files\n"
        "from toren.sandbox.store import LocalStore\n"
        "import toren.sandbox, toren.sandboxes, toren.sandboxes.files, toren.sandboxes.store\n"
        "assert toren.sandbox is toren.sandboxes\n"
        "assert old_files is toren.sandboxes.files\n"
        "assert LocalStore is toren.sandboxes.store.LocalStore\n"
        "assert Sandbox is toren.sandboxes.Sandbox\n"
        "assert toren.sandboxes.files.__spec__.name == 'toren.sandboxes.files'\n"
        "print('same')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "same"
