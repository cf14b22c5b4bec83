"""Exceptions Meridian raises to its callers. Stdlib only, so every folder may import it.

Each message says what is wrong and what to change; the HTTP layer maps them to status codes.
"""


class MeridianError(Exception):
    """Base class of every error Meridian raises on purpose."""

    http_status = 500


class InvalidRequestError(MeridianError, ValueError):
    """The request itself is malformed (empty prompt, bad sampling values, ...)."""

    http_status = 400


class ContextLengthError(InvalidRequestError):
    """Prompt plus requested tokens do not fit the model's context window."""


class ModelLoadError(MeridianError):
    """A model folder is missing files or holds an architecture we do not support."""
