"""The schedule kind's surfaces, named by where they live. Light to import: the CLI reads it
to describe its commands, and each surface imports only its own part."""

from toren._core.surfaces import Surfaces

SURFACES = Surfaces()
