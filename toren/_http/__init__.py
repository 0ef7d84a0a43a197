"""The HTTP surface: the API, its OpenAPI document, the console. See :func:`create_app`."""

from toren._http.app import create_app

__all__ = ["create_app"]
