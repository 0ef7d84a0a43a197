"""The channel kind's surfaces, named by where they live: ``toren channels``, and the
``/channels`` routes with Telegram's webhook. Light to import: the CLI reads it to describe its
commands, and each surface imports only its own part."""

from toren._core.surfaces import Surfaces

SURFACES = Surfaces(
    cli=("toren._cli.channels:register",),
    http=("toren._surfaces.http.channels:install",),
)
