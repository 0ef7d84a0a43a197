"""The old deploy of tests/deploy_app.py (``toren worker --app tests.deploy_old_app``)."""

from tests.deploy_app import deploy

pinned, convo, loose = deploy("OLD")
