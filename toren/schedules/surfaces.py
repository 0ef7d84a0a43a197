"""The schedule kind's surfaces, named by where they live: ``toren schedules``, the
``/schedules`` routes and the schedules' MCP tools. Light to import: the CLI reads it to
describe its commands, and each surface imports only its own part."""

from toren._core.surfaces import Surfaces

SURFACES = Surfaces(
    cli=("toren._cli.schedules:register",),
    http=("toren._surfaces.http.schedules:install",),
    mcp=("toren._surfaces.mcp_schedules:install",),
)
