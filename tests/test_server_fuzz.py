"""Property-based fuzzing of every endpoint: malformed bodies, made from the OpenAPI schema the
server publishes, must each get a 4xx with OpenAI's error JSON, and the server must go on serving.

A malformed body is a valid one (built from the published schema: required fields and a random
choice of optional ones, each a schema-valid value) with one fault: a field of a JSON type its
schema does not accept (at the top or inside messages / input_extra), an unknown field, or a
required field missing; or bytes that are not JSON; or JSON that is not an object. Every body is
malformed by construction, so none reaches the engine and the fuzzing takes seconds.
"""

from __future__ import annotations

import json
import string

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pynanoqwen.server.protocol import ENDPOINTS
from server_harness import embedded, serving

EXAMPLES = 300  # per strategy and endpoint
JSON_TYPES = ("null", "boolean", "integer", "fraction", "string", "array", "object")
SCALARS = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(max_size=20)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=4), max_leaves=12)
NOT_OBJECTS = JSON.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode())
sent = {"requests": 0}


@pytest.fixture(scope="module")
def server():
    backend, model = embedded()
    with serving(backend, model) as url, httpx.Client(base_url=url, timeout=30) as http:
        yield http, model, http.get("/openapi.json").json()


def accepted(schema: dict) -> set[str]:
    """The JSON types (of JSON_TYPES) a value of this schema may have; all of them for {}."""
    if "oneOf" in schema:
        types = set().union(*(accepted(option) for option in schema["oneOf"]))
    elif "enum" in schema:
        types = {"string" if isinstance(v, str) else "boolean" if isinstance(v, bool) else "integer"
                 for v in schema["enum"]}
    elif "type" not in schema:
        types = set(JSON_TYPES)
    else:
        types = {"number": {"integer", "fraction"}}.get(schema["type"], {schema["type"]})
    return types | ({"null"} if schema.get("nullable") else set())


def of_type(kind: str):
    return {"null": st.none(), "boolean": st.booleans(), "integer": st.integers(-2**70, 2**70),
            "fraction": st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: x != int(x)),
            "string": st.text(max_size=10), "array": st.lists(SCALARS, max_size=3),
            "object": st.dictionaries(st.text(max_size=5), SCALARS, max_size=3)}[kind]


def wrong(schema: dict):
    """A value of a JSON type `schema` refuses, or None when it takes every type."""
    kinds = [kind for kind in JSON_TYPES if kind not in accepted(schema)]
    return st.sampled_from(kinds).flatmap(of_type) if kinds else None


def valid(schema: dict):
    """A value the schema accepts (the server may still refuse it for what it means)."""
    if "oneOf" in schema:
        return st.one_of(*(valid(option) for option in schema["oneOf"]))
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "string":
        return st.text(string.printable, min_size=schema.get("minLength", 0), max_size=schema.get("maxLength", 12))
    if kind == "integer":
        return st.integers(schema.get("minimum", -5), schema.get("maximum", 500))
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum", -5.0))
        return st.floats(low, schema.get("maximum", 5.0), exclude_min="exclusiveMinimum" in schema)
    if kind == "boolean":
        return st.booleans()
    if kind == "array":
        return st.lists(valid(schema["items"]), min_size=schema.get("minItems", 0),
                        max_size=schema.get("maxItems", 2))
    if kind == "object" and "properties" in schema:
        return valid_object(schema, optional=False)
    return SCALARS


def valid_object(schema: dict, optional: bool = True):
    required = {name: valid(schema["properties"][name]) for name in schema["required"]}
    others = sorted(set(schema["properties"]) - set(schema["required"]))
    if not optional or not others:
        return st.fixed_dictionaries(required)
    return st.fixed_dictionaries(required, optional={n: valid(schema["properties"][n]) for n in others})


@st.composite
def malformed(draw, schema: dict, model_id: str):
    body = draw(valid_object(schema))
    if "model" in body:
        body["model"] = model_id
    fault = draw(st.sampled_from(("wrong type", "wrong type inside", "unknown field", "missing field")))
    nested = [n for n, s in schema["properties"].items() if s.get("type") == "array" and "properties" in s["items"]]
    if fault == "wrong type inside" and nested:
        name = draw(st.sampled_from(nested))
        item_schema = schema["properties"][name]["items"]
        item = draw(valid_object(item_schema))
        fields = item_schema["properties"]
        field = draw(st.sampled_from([f for f in fields if wrong(fields[f]) is not None]))
        item[field] = draw(wrong(item_schema["properties"][field]))
        body[name] = [item]
    elif fault == "unknown field":
        body[draw(st.text(min_size=1, max_size=12).filter(lambda n: n not in schema["properties"]))] = draw(JSON)
    elif fault == "missing field" and schema["required"]:
        del body[draw(st.sampled_from(schema["required"]))]
    else:
        name = draw(st.sampled_from([n for n, s in schema["properties"].items() if wrong(s) is not None]))
        body[name] = draw(wrong(schema["properties"][name]))
    return json.dumps(body).encode()


def check_refused(http, path: str, content: bytes) -> None:
    answer = http.post(path, content=content)
    sent["requests"] += 1
    assert 400 <= answer.status_code < 500, (path, content[:300], answer.status_code, answer.text[:300])
    error = answer.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)


FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_malformed_bodies_from_the_published_schema(server, path):
    http, model, document = server
    assert document["paths"][path]["post"]  # every generation endpoint is published
    schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]

    @FUZZ
    @given(malformed(schema, model.id))
    def fuzz(content):
        check_refused(http, path, content)

    fuzz()


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_bytes_and_json_that_are_not_a_request_object(server, path):
    http, _, _ = server

    @FUZZ
    @given(st.binary(max_size=64) | NOT_OBJECTS)
    def fuzz(content):
        check_refused(http, path, content)

    fuzz()


def test_any_method_on_any_path_is_never_a_server_error(server):
    http, _, _ = server
    known = st.sampled_from(list(ENDPOINTS) + ["/v1/models", "/health", "/metrics", "/v1/models/", "/openapi.json"])

    @FUZZ
    @given(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
           known | st.text(string.ascii_letters + "/._-", max_size=20).map(lambda p: "/" + p), st.binary(max_size=32))
    def fuzz(method, path, content):
        answer = http.request(method, path, content=content)
        sent["requests"] += 1
        assert answer.status_code < 500, (method, path, answer.status_code, answer.text[:300])
        if answer.status_code >= 400:
            assert answer.json()["error"]["message"]

    fuzz()


def test_the_server_still_serves_after_the_fuzzing(server):
    http, model, _ = server
    assert http.get("/health").status_code == 200
    answer = http.post("/v1/completions", json={"model": model.id, "prompt": "def f():", "max_tokens": 4})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
    print(f"\nfuzzing sent {sent['requests']} requests")
