"""Structured output through the official openai client: response_format (chat), so_args and vLLM's
structured_outputs in extra_body (completions and chat), and a 400 for every bad constraint."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.sample.json_schemas import CODE_REGEX, ORDER_SCHEMA
from tests.server.conftest import MODEL

try:  # a test dependency: fail, never skip, when it is missing
    import xgrammar  # noqa: F401
except ImportError:
    pytest.fail("xgrammar is missing: pip install --no-deps xgrammar==0.2.9 (see the test extra in pyproject.toml)",
                pytrace=False)

pytestmark = pytest.mark.slow

SCHEMA, REGEX = ORDER_SCHEMA, CODE_REGEX
SEEDS = (None, 1, 2)  # None: greedy


def _sampling(seed: int | None) -> dict:
    return {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}


def _chat(client, question: str, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}], **kwargs)


@pytest.mark.parametrize("seed", SEEDS)
def test_chat_json_schema_validates(client, seed):
    response_format = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA, "strict": True}}
    choice = _chat(client, "Order some paint as JSON.", max_tokens=40, response_format=response_format,
                   **_sampling(seed)).choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_chat_json_object_streamed_is_an_object(client):
    stream = _chat(client, "Describe a cat as a JSON object with the keys name and age.", max_tokens=120, temperature=0,
                   response_format={"type": "json_object"}, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("seed", SEEDS)
def test_completion_so_args_regex_fullmatches(client, seed):
    choice = client.completions.create(model=MODEL, prompt="A product code:", max_tokens=12, **_sampling(seed),
                                       extra_body={"so_args": {"schema_type": "regex", "schema": REGEX}}).choices[0]
    assert choice.finish_reason == "stop" and re.fullmatch(REGEX, choice.text), choice


def test_completion_response_format_json_schema(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA}}
    choice = client.completions.create(model=MODEL, prompt="A paint order in JSON:", max_tokens=40, temperature=0,
                                       extra_body={"response_format": response_format}).choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.text), SCHEMA)


@pytest.mark.parametrize("seed", SEEDS)
def test_chat_vllm_grammar_and_choice(client, seed):
    grammar = _chat(client, "Is the sky blue?", max_tokens=12, **_sampling(seed),
                    extra_body={"structured_outputs": {"grammar": 'root ::= "answer=" ("yes" | "no")'}}).choices[0]
    assert grammar.finish_reason == "stop" and grammar.message.content in ("answer=yes", "answer=no"), grammar
    choices = ["a-b (1)", "c.d?"]
    choice = _chat(client, "Pick one.", max_tokens=12, **_sampling(seed),
                   extra_body={"structured_outputs": {"choice": choices}}).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content in choices, choice


BAD = [
    # (route, extra request fields, the error's param, a fragment of its message)
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}},
     "response_format", "'uniqueItems': true is not supported"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "invalid JSON schema"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "'response_format.json_schema' is required"),
    ("completions", {"so_args": {"schema_type": "regex", "schema": "[A-Z"}}, "so_args", "invalid regex"),
    ("completions", {"so_args": {"schema_type": "xml", "schema": "x"}}, "so_args", "schema_type"),
    ("chat", {"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs", "invalid EBNF grammar"),
    ("chat", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ("completions", {"so_args": {"schema_type": "regex", "schema": "a"}, "structured_outputs": {"regex": "b"}},
     None, "at most one of"),
]


@pytest.mark.parametrize("route, fields, param, message", BAD, ids=[f"{b[0]}-{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_constraint_is_a_400_and_the_server_keeps_serving(client, route, fields, param, message):
    with pytest.raises(openai.BadRequestError) as caught:
        if route == "chat":
            _chat(client, "Hi", max_tokens=4, extra_body=fields)
        else:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body=fields)
    error = caught.value.body
    assert caught.value.status_code == 400 and set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["param"] == param and message in error["message"], error
    after = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"ignore_eos": True})
    assert after.choices[0].finish_reason == "length"  # still serving (sampled: EOS could otherwise come first)
