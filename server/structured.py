"""A request's structured-output fields, as OpenAI and vLLM spell them, read into one
`engines.grammar.StructuredOutput`: OpenAI's `response_format` (`json_object`, `json_schema`),
vLLM's `structured_outputs` ({"json": ..., "regex": ..., "choice": [...], "grammar": ...}) and
its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. A request gives at
most one of them: two constraints at once have no meaning the server could honour."""
from __future__ import annotations

from typing import Any

from engines.grammar import StructuredOutput

# vLLM's older fields -> the kind each names
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StructuredFieldError(ValueError):
    """A structured-output field the server cannot honour; `param` names it for the 400."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def structured_of(body: Any) -> StructuredOutput | None:
    """-> the request's constraint, None when it asks for none (or for `response_format` text)."""
    fields = {"response_format": body.response_format, "structured_outputs": body.structured_outputs,
              "guided_json": body.guided_json, "guided_regex": body.guided_regex,
              "guided_choice": body.guided_choice, "guided_grammar": body.guided_grammar}
    given = {name: value for name, value in fields.items() if value is not None}
    if given.get("response_format") == {"type": "text"}:  # OpenAI's default: no constraint
        del given["response_format"]
    if len(given) > 1:
        names = sorted(given)
        raise StructuredFieldError(names[1], f"{' and '.join(names)} each constrain the output: give one of them")
    if not given:
        return None
    (name, value), = given.items()
    try:
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":
            return StructuredOutput.from_mapping(value, name)
        return StructuredOutput.of(GUIDED[name], value, name)
    except ValueError as e:
        raise StructuredFieldError(name, str(e)) from None


def _response_format(rf: dict[str, Any]) -> StructuredOutput:
    kind = rf.get("type")
    extra = sorted(set(rf) - {"type", "json_schema"})
    if extra:
        raise ValueError(f"response_format.{extra[0]}: unknown field")
    if kind == "json_object":
        return StructuredOutput.of("json_object", where="response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ValueError("response_format.json_schema: an object with the schema is required for type json_schema")
        if "schema" not in js:
            raise ValueError("response_format.json_schema.schema: required (the JSON schema the output follows)")
        unknown = sorted(set(js) - {"name", "schema", "strict", "description"})
        if unknown:
            raise ValueError(f"response_format.json_schema.{unknown[0]}: unknown field")
        return StructuredOutput.of("json", js["schema"], "response_format.json_schema.schema")
    raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
