"""The retention kind's surfaces, named by where they live: ``toren jobs prune``, ``toren
costs`` and ``toren db sizes``; ``GET /costs``. Light to import."""

from toren._core.surfaces import Surfaces

SURFACES = Surfaces(
    cli=("toren._cli.retention:register",),
    http=("toren._surfaces.http.retention:install",),
)
