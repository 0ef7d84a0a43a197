"""The sandbox kind's surfaces, named by where they live: ``toren sandboxes`` (its HTTP
reads are the runs' own). Light to import: the CLI reads it to describe its commands."""

from toren._core.surfaces import Surfaces

SURFACES = Surfaces(cli=("toren._cli.sandboxes:register",))
