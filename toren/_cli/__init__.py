"""The command line and ``toren dev``: each command group in its module."""
