"""Exceptions Meridian raises to its callers. Stdlib only, so every folder may import it.

Each message says what is wrong and what to change; the HTTP layer maps them to status codes.
"""


class MeridianError(Exception):
    """Base class of every error Meridian raises on purpose."""

    http_status = 500


class InvalidRequestError(MeridianError, ValueError):
    """The request itself is malformed (empty prompt, bad sampling values, ...).
    ``param``: the request field to fix, when one is to blame (the HTTP error names it)."""

    http_status = 400

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """Prompt plus requested tokens do not fit the model's context window."""


class ModelLoadError(MeridianError):
    """A model folder is missing files or holds an architecture we do not support."""


class PackageUnavailable(MeridianError):
    """A package that ships a model or a dataset is not installed (or lacks its file)."""


class OverloadedError(MeridianError):
    """The replica cannot take the request now; retry after a moment (HTTP 429).
    ``retry_after``: seconds the engine suggests (None: the server's default)."""

    http_status = 429

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineUnavailableError(MeridianError):
    """The engine failed to take the request (a dead actor, a bug); retry it (HTTP 503)."""

    http_status = 503
