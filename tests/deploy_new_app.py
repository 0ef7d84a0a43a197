"""The new deploy of tests/deploy_app.py (``toren worker --app tests.deploy_new_app``)."""

from tests.deploy_app import deploy

pinned, convo, loose = deploy("NEW")
