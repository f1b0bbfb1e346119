"""Request bodies, declared once: each declaration both checks a JSON value and writes its JSON schema.

The server publishes the schemas at /openapi.json, and the same objects validate every request,
so the published schema and the checks cannot disagree. A check returns the value (with defaults
filled in for objects) or raises ApiError 400 naming the offending field by its path
(`messages[2].content`), in OpenAI's words where OpenAI has them.

Types: Str, Int, Number, Bool, Choice (one of some constants), Anything, ListOf, OneOf, MapOf,
Nullable (null means the default), Object (named fields, unknown ones refused), and Neutral: an
OpenAI option this server cannot honour, accepted only at the value that means "off".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import ApiError

MISSING = object()  # a field absent from the body


def _kind(value: Any) -> str:
    """The JSON name of a value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _invalid(path: str, expected: str, value: Any) -> ApiError:
    return ApiError(400, f"Invalid type for '{path}': expected {expected}, but got {_kind(value)} instead.",
                    param=path, code="invalid_type")


def _out_of_range(path: str, message: str) -> ApiError:
    return ApiError(400, f"Invalid value for '{path}': {message}.", param=path, code="invalid_value")


class Type:
    """A JSON type: check(value, path) returns the accepted value; schema() its JSON schema."""

    expected = "a value"

    def check(self, value: Any, path: str) -> Any:
        raise NotImplementedError

    def schema(self) -> dict:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Str(Type):
    max_length: int | None = None
    min_length: int = 0
    expected = "a string"

    def check(self, value, path):
        if not isinstance(value, str):
            raise _invalid(path, self.expected, value)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:  # JSON's "\ud800" escapes decode to half a character
            raise _out_of_range(path, f"not valid Unicode: a lone surrogate at character {err.start}") from None
        if len(value) < self.min_length:
            raise _out_of_range(path, f"must not be shorter than {self.min_length} characters")
        if self.max_length is not None and len(value) > self.max_length:
            raise _out_of_range(path, f"must be at most {self.max_length} characters")
        return value

    def schema(self):
        return {"type": "string", "minLength": self.min_length,
                **({"maxLength": self.max_length} if self.max_length is not None else {})}


@dataclasses.dataclass(frozen=True)
class Int(Type):
    minimum: int | None = None
    maximum: int | None = None
    expected = "an integer"

    def check(self, value, path):
        if isinstance(value, bool) or not isinstance(value, int):
            raise _invalid(path, self.expected, value)
        if self.minimum is not None and value < self.minimum:
            raise _out_of_range(path, f"{value} is less than the minimum of {self.minimum}")
        if self.maximum is not None and value > self.maximum:
            raise _out_of_range(path, f"{value} is greater than the maximum of {self.maximum}")
        return value

    def schema(self):
        bounds = {"minimum": self.minimum, "maximum": self.maximum}
        return {"type": "integer", **{k: v for k, v in bounds.items() if v is not None}}


@dataclasses.dataclass(frozen=True)
class Number(Type):
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    expected = "a number"

    def check(self, value, path):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _invalid(path, self.expected, value)
        try:
            value = float(value)
        except OverflowError:  # an integer literal beyond any double, e.g. 1 followed by 400 zeros
            raise _out_of_range(path, "the number is too large") from None
        if not math.isfinite(value):  # json.loads reads 1e400 as inf, and takes NaN and Infinity
            raise _out_of_range(path, "the number must be finite")
        if self.minimum is not None and (value <= self.minimum if self.exclusive_minimum else value < self.minimum):
            raise _out_of_range(path, f"{value} must be {'greater than' if self.exclusive_minimum else 'at least'} "
                                      f"{self.minimum}")
        if self.maximum is not None and value > self.maximum:
            raise _out_of_range(path, f"{value} is greater than the maximum of {self.maximum}")
        return value

    def schema(self):
        out: dict = {"type": "number"}
        if self.minimum is not None:
            out["exclusiveMinimum" if self.exclusive_minimum else "minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        return out


@dataclasses.dataclass(frozen=True)
class Bool(Type):
    expected = "a boolean"

    def check(self, value, path):
        if not isinstance(value, bool):
            raise _invalid(path, self.expected, value)
        return value

    def schema(self):
        return {"type": "boolean"}


@dataclasses.dataclass(frozen=True)
class Choice(Type):
    values: tuple

    @property
    def expected(self):
        return "one of " + ", ".join(repr(v) for v in self.values)

    def check(self, value, path):
        if not any(type(value) is type(v) and value == v for v in self.values):
            raise _out_of_range(path, f"{value!r} is not {self.expected}")
        return value

    def schema(self):
        return {"enum": list(self.values)}


@dataclasses.dataclass(frozen=True)
class Anything(Type):
    expected = "any JSON value"

    def check(self, value, path):
        return value

    def schema(self):
        return {}


@dataclasses.dataclass(frozen=True)
class ListOf(Type):
    item: Type
    min_items: int = 0
    max_items: int | None = None

    @property
    def expected(self):
        return "an array"

    def check(self, value, path):
        if not isinstance(value, list):
            raise _invalid(path, self.expected, value)
        if len(value) < self.min_items:
            raise _out_of_range(path, f"expected at least {self.min_items} items, got {len(value)}")
        if self.max_items is not None and len(value) > self.max_items:
            raise _out_of_range(path, f"expected at most {self.max_items} items, got {len(value)}")
        return [self.item.check(v, f"{path}[{i}]") for i, v in enumerate(value)]

    def schema(self):
        return {"type": "array", "items": self.item.schema(), "minItems": self.min_items,
                **({"maxItems": self.max_items} if self.max_items is not None else {})}


@dataclasses.dataclass(frozen=True)
class OneOf(Type):
    """A value of any of `options`, tried in order. When none accepts it, the error is the first
    one about its content (an option of its JSON type found something wrong inside), if any."""

    options: tuple[Type, ...]

    @property
    def expected(self):
        return " or ".join(option.expected for option in self.options)

    def check(self, value, path):
        content_errors = []
        for option in self.options:
            try:
                return option.check(value, path)
            except ApiError as err:
                if err.code != "invalid_type" or err.param != path:
                    content_errors.append(err)
        raise content_errors[0] if content_errors else _invalid(path, self.expected, value)

    def schema(self):
        return {"oneOf": [option.schema() for option in self.options]}


@dataclasses.dataclass(frozen=True)
class MapOf(Type):
    """A JSON object with any keys, each value of type `value`."""

    value: Type
    expected = "an object"

    def check(self, value, path):
        if not isinstance(value, dict):
            raise _invalid(path, self.expected, value)
        return {key: self.value.check(item, f"{path}.{key}") for key, item in value.items()}

    def schema(self):
        return {"type": "object", "additionalProperties": self.value.schema()}


@dataclasses.dataclass(frozen=True)
class Nullable(Type):
    """`inner`, or null: a field set to null gets its default, as in OpenAI's API."""

    inner: Type

    @property
    def expected(self):
        return f"{self.inner.expected} or null"

    def check(self, value, path):
        return None if value is None else self.inner.check(value, path)

    def schema(self):
        return {**self.inner.schema(), "nullable": True}


@dataclasses.dataclass(frozen=True)
class Neutral(Type):
    """An option this server does not implement, accepted only at `value`, which turns it off."""

    inner: Type
    value: Any
    why: str

    @property
    def expected(self):
        return self.inner.expected

    def check(self, value, path):
        if value is not None:
            value = self.inner.check(value, path)
        if value is not None and value != self.value:
            raise ApiError(400, f"'{path}' is not supported ({self.why}); only {self.value!r} is accepted.",
                           param=path, code="unsupported_value")
        return self.value

    def schema(self):
        return {**self.inner.schema(), "nullable": True, "description": f"only {self.value!r}: {self.why}"}


@dataclasses.dataclass(frozen=True)
class Field:
    type: Type
    default: Any = None
    required: bool = False
    description: str = ""


@dataclasses.dataclass(frozen=True)
class Object(Type):
    """A JSON object with these fields; a field not listed is refused, as OpenAI does."""

    fields: Mapping[str, Field]
    expected = "an object"

    def check(self, value, path):
        if not isinstance(value, dict):
            raise _invalid(path or "body", self.expected, value)
        for name in value:
            if name not in self.fields:
                where = f"{path}.{name}" if path else name
                raise ApiError(400, f"Unrecognized request argument supplied: {where}", param=where,
                               code="unknown_field")
        out = {}
        for name, field in self.fields.items():
            where = f"{path}.{name}" if path else name
            given = value.get(name, MISSING)
            if given is MISSING and field.required:
                raise ApiError(400, f"Missing required parameter: '{where}'.", param=where, code="missing_field")
            checked = None if given is MISSING else field.type.check(given, where)
            out[name] = field.default if checked is None else checked
        return out

    def schema(self):
        properties = {}
        for name, field in self.fields.items():
            prop = field.type.schema()
            if field.description:
                prop["description"] = (prop.get("description", "") + " " + field.description).strip()
            if field.default is not None:
                prop["default"] = field.default
            properties[name] = prop
        return {"type": "object", "properties": properties, "additionalProperties": False,
                "required": [name for name, field in self.fields.items() if field.required]}


def fields(**declared: Field | Type) -> dict[str, Field]:
    """Field declarations by name; a bare Type is an optional field without a default."""
    return {name: f if isinstance(f, Field) else Field(f) for name, f in declared.items()}


def text_list(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """A `stop` value (one string, a list of them, or nothing) as a tuple."""
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)
