"""The ingress's admin routes: who may call them and what they take.

``POST /admin/update_weights`` with ``{"path": "/abs/model-or.safetensors",
"abort_in_flight": false}`` loads new weights into every replica of the app (the router's
weight log, ``weight_updates.py``) and answers ``{"weight_version": n}`` once all have.
``POST /admin/sleep`` with ``{"level": 1 | 2}`` answers ``{"freed_bytes": n}`` once every
replica sleeps; ``POST /admin/wake_up`` answers ``{"awake": true}`` once all woke.

Access: an API key whose ``role`` is ``admin``. No key or an unknown one: 401; a user
key: 403 naming the role needed. With no ``api_keys`` configured (auth off) the admin
routes are refused with 403: anyone who can reach the port could otherwise replace the
model. A process connected to the Ray cluster can use the ingress's ``update_weights``
handle method instead (it can already do anything to the cluster's actors).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from actors.serving import openai_protocol as oai
from actors.serving.config import ApiKeyConfig
from errors import EngineUnavailableError, InvalidRequestError, MeridianError


class UpdateWeightsBody(BaseModel):
    """``path``: a ``.safetensors`` file or a folder of them, on the server's filesystem
    (read by the router deployment's process, so on its node)."""

    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1)
    abort_in_flight: bool = False

    @classmethod
    def parse(cls, raw: object) -> UpdateWeightsBody:
        try:
            body = cls.model_validate(raw)
        except ValidationError as e:
            raise oai.validation_error(e) from None
        if not PurePosixPath(body.path).is_absolute():
            msg = f"path must be absolute (a file or folder on the server): {body.path!r}"
            raise oai.APIError(400, msg, "path")
        return body


class SleepBody(BaseModel):
    """``POST /admin/sleep``: 1 frees every replica's KV cache, 2 its weights too."""

    model_config = ConfigDict(extra="forbid")
    level: Literal[1, 2] = 1

    @classmethod
    def parse(cls, raw: object) -> SleepBody:
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            raise oai.validation_error(e) from None


def require_admin(tenant: ApiKeyConfig | None, keys_configured: bool) -> None:
    """Refuse (403) unless ``tenant`` (the caller's key, already checked: 401 before this)
    has the admin role."""
    if not keys_configured:
        raise oai.APIError(
            403,
            "admin routes need an API key with role 'admin', and this server has no api_keys "
            "configured; add one with role: admin to the config",
            code="admin_key_required",
        )
    assert tenant is not None
    if tenant.role != "admin":
        raise oai.APIError(
            403,
            f"this route needs an API key with role 'admin'; this key's role is {tenant.role!r}",
            code="admin_key_required",
        )


def admin_error(e: Exception) -> oai.APIError:
    """The HTTP error of a failed admin call (``e``: what the router raised, maybe wrapped
    by Ray: its ``cause``)."""
    cause = getattr(e, "cause", None) or e
    if isinstance(cause, InvalidRequestError):
        return oai.APIError(400, str(cause), cause.param)
    if isinstance(cause, EngineUnavailableError):
        return oai.APIError(503, str(cause))
    if isinstance(cause, MeridianError):
        return oai.APIError(500, str(cause))
    return oai.APIError(503, f"the router is unavailable: {type(cause).__name__}: {cause}")
