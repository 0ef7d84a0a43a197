"""The HTTP surface: the API, its OpenAPI document, the console. See :func:`create_app`."""

from toren._surfaces.http.app import create_app
from toren._surfaces.http.common import ServerOptions

__all__ = ["ServerOptions", "create_app"]
