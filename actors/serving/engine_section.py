"""``EngineConfig`` as a pydantic field: the ``engine`` section of a replica group.

``EngineSection`` validates a mapping of ``EngineConfig`` fields (an unknown key is an
error at its own path, e.g. ``groups[0].engine.tokn_budget``) and yields the frozen
``EngineConfig`` itself, built once; an ``EngineConfig`` object passes as is. The
mirror model is generated from the dataclass's fields, so the fields and their defaults
live only in actors/engine/config.py. A section dumps as the fields that differ from
their defaults (``engine_options``), so ``model_dump`` -> ``model_validate`` round-trips.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, create_model
from pydantic.errors import PydanticSchemaGenerationError
from pydantic_core import core_schema

from actors.engine.config import EngineConfig


def _field_type(annotation: Any) -> Any:
    """The field's annotation when pydantic can check it (ints, floats, strings, bools,
    lists, dicts), else Any: objects such as an ``Ordering`` or a torch dtype are passed
    through to ``EngineConfig``, which checks them itself."""
    module = vars(sys.modules[EngineConfig.__module__])
    try:  # a string under ``from __future__ import annotations``: the dataclass's own text
        resolved = eval(annotation, module) if isinstance(annotation, str) else annotation
        TypeAdapter(resolved)
    except (NameError, AttributeError, TypeError, SyntaxError, PydanticSchemaGenerationError):
        return Any
    return resolved


def _default(f: dataclasses.Field[Any]) -> Any:
    return None if f.default is dataclasses.MISSING else f.default


_FIELDS: dict[str, Any] = {
    f.name: (_field_type(f.type), _default(f)) for f in dataclasses.fields(EngineConfig)
}
_Mirror: type[BaseModel] = create_model(
    "EngineSection", __config__=ConfigDict(extra="forbid"), **_FIELDS
)
_DEFAULTS = EngineConfig()


def engine_options(config: EngineConfig) -> dict[str, Any]:
    """The fields of ``config`` that differ from ``EngineConfig``'s defaults."""
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != getattr(_DEFAULTS, f.name)
    }


class _EngineSchema:
    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        def validate(value: Any, inner: core_schema.ValidatorFunctionWrapHandler) -> Any:
            if isinstance(value, EngineConfig):
                return value
            section = inner(value)  # its errors keep their paths under the field
            fields = {name: getattr(section, name) for name in section.model_fields_set}
            return EngineConfig(**fields)  # __post_init__'s ValueError: at the field

        return core_schema.no_info_wrap_validator_function(
            validate,
            _Mirror.__pydantic_core_schema__,
            serialization=core_schema.plain_serializer_function_ser_schema(engine_options),
        )


EngineSection = Annotated[EngineConfig, _EngineSchema]
