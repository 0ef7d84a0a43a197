"""The kernel: actors, mailboxes, journals, leases, the worker's session, migrations.

Nothing here imports from the floors above it (the agent layer, the kinds, the surfaces)."""
