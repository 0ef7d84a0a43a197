"""The run kind's surfaces, named by where they live: ``toren run`` and ``toren jobs``, the
``/runs`` routes, and the MCP tools on runs. Light to import: the CLI reads it to describe its
commands, and each surface imports only its own part."""

from toren._core.surfaces import Surfaces

SURFACES = Surfaces(
    cli=("toren._cli.runs:register",),
    http=(
        "toren._surfaces.http.runs:install",
        "toren._surfaces.http.versions:install",
        "toren._surfaces.http.forks:install",
        "toren._surfaces.http.archives:install",
    ),
    mcp=("toren._surfaces.mcp_runs:install",),
)
