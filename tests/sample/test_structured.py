"""Grammar backend for structured output, driven by seeded random walks (no model).

A walk samples uniformly among the tokens the grammar allows; after a few
steps it leans towards short and closing tokens so that walks end, without
ever leaving the allowed set. Whatever a walk produces must match the grammar.
"""
from __future__ import annotations

import json
import os
import random
import re
import threading

import pytest
import torch

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from deepinfer.models.gguf_views import plain_gguf_views  # noqa: E402
from deepinfer.models.loader import resolve_model_path  # noqa: E402
from deepinfer.sample.structured import GrammarCompiler, GrammarMatcher, fill_masks  # noqa: E402
from tests.sample.json_schemas import (  # noqa: E402
    APPROXIMATE, CODE_REGEX, ORDER_SCHEMA, REFUSED, SUPPORTED, YES_NO_EBNF,
)

VOCAB = 49152
REGEX = {"schema_type": "regex", "schema": CODE_REGEX}
SCHEMA = ORDER_SCHEMA
JSON = {"schema_type": "json", "schema": SCHEMA}
EBNF = {"schema_type": "ebnf", "schema": YES_NO_EBNF}
FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # Walks do thousands of tiny tensor ops; thread hand-offs would dominate them.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    gguf = resolve_model_path(None)  # the bundled model, wherever its package is installed
    with plain_gguf_views():
        return transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB)


class Walker:
    """Token classes for steering walks towards an end: tokens holding a closing
    character, and one-byte punctuation (which includes every JSON separator)."""

    def __init__(self, tokenizer, eos: int) -> None:
        import xgrammar

        pieces = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB).decoded_vocab
        self.tokenizer = tokenizer
        self.eos = eos
        self.closing = torch.tensor([any(c in p for c in b'"]}') for p in pieces])
        self.punct = torch.tensor([len(p) == 1 and not chr(p[0]).isalnum() for p in pieces])

    def walk(self, matcher: GrammarMatcher, rng: random.Random, wander: int = 12, max_steps: int = 2000) -> str:
        ids: list[int] = []
        for step in range(max_steps):
            allowed = matcher.allowed_mask()
            if allowed[self.eos] and (step >= wander or rng.random() < 0.3 or allowed.sum() == 1):
                assert matcher.accept_token(self.eos)
                break
            allowed[self.eos] = False
            choice = allowed
            if step >= wander:
                pool = rng.choices((allowed & self.closing, allowed & self.punct, allowed), (0.4, 0.4, 0.2))[0]
                choice = pool if pool.any() else allowed
            candidates = choice.nonzero().flatten()
            assert len(candidates), f"nothing allowed after {self.tokenizer.decode(ids)!r} and EOS not allowed"
            token = int(candidates[rng.randrange(len(candidates))])
            assert matcher.accept_token(token)
            ids.append(token)
        assert matcher.is_terminated(), f"walk did not end: {self.tokenizer.decode(ids)[:200]!r}"
        return self.tokenizer.decode(ids)


@pytest.fixture(scope="module")
def walker(tokenizer):
    return Walker(tokenizer, tokenizer.eos_token_id)


def test_regex_walks_fullmatch(compiler, walker):
    rng = random.Random(0)
    outputs = {walker.walk(GrammarMatcher(compiler.compile(REGEX)), rng) for _ in range(40)}
    for text in outputs:
        assert re.fullmatch(REGEX["schema"], text), text
    assert len(outputs) > 20


@pytest.mark.parametrize("regex", [
    r"^(yes|no)$",
    r"a.c",
    r"[^.]{1,3}\.[.]x",
    r"\d{3}-\d{4}",
    r"(foo|bar)+baz",
    r"[\w.+-]{1,8}@[a-z]{2,5}\.(com|org)",
    r"-?(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?",
    r"[a-c]*?x\$",
])
def test_regex_semantics_match_python_re(compiler, walker, regex):
    grammar = compiler.compile({"schema_type": "regex", "schema": regex})
    rng = random.Random(regex)
    for _ in range(10):
        text = walker.walk(GrammarMatcher(grammar), rng)
        assert re.fullmatch(regex, text), (regex, text)


def test_json_walks_validate(compiler, walker):
    rng = random.Random(1)
    seen = set()
    for _ in range(40):
        value = json.loads(walker.walk(GrammarMatcher(compiler.compile(JSON)), rng))
        jsonschema.validate(value, SCHEMA)
        seen.add(value["color"])
    assert seen == {"red", "green", "blue"}


def test_json_output_is_compact(compiler, walker):
    text = walker.walk(GrammarMatcher(compiler.compile(JSON)), random.Random(2))
    assert re.fullmatch(r'\{"color": "(red|green|blue)", "quantity": [0-9]+\}', text), text


def test_ebnf_walks(compiler, walker):
    rng = random.Random(3)
    outputs = [walker.walk(GrammarMatcher(compiler.compile(EBNF)), rng) for _ in range(20)]
    assert set(outputs) == {"answer=yes", "answer=no"}


def test_json_without_schema_is_any_object(compiler, walker):
    rng = random.Random(4)
    for _ in range(10):
        text = walker.walk(GrammarMatcher(compiler.compile({"schema_type": "json", "schema": None})), rng)
        assert isinstance(json.loads(text), dict), text


def _accept_text(matcher: GrammarMatcher, tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(matcher.accept_token(t) for t in ids), text
    return ids


def test_eos_only_when_grammar_can_end(compiler, tokenizer):
    matcher = GrammarMatcher(compiler.compile(REGEX))
    eos = tokenizer.eos_token_id
    assert not matcher.allowed_mask()[eos]
    _accept_text(matcher, tokenizer, "AB-12")
    assert not matcher.allowed_mask()[eos]
    assert not matcher.accept_token(eos)
    _accept_text(matcher, tokenizer, "3")
    mask = matcher.allowed_mask()
    assert mask.nonzero().flatten().tolist() == [eos]
    assert matcher.accept_token(eos) and matcher.is_terminated()


def test_special_tokens_never_allowed(compiler, tokenizer):
    matcher = GrammarMatcher(compiler.compile({"schema_type": "json", "schema": {"type": "string"}}))
    _accept_text(matcher, tokenizer, '"abc')
    mask = matcher.allowed_mask()
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    assert not any(mask[i] for i in special)
    assert not matcher.accept_token(1)  # <|im_start|> as text inside a string


def test_rejected_token_leaves_state(compiler, tokenizer):
    matcher = GrammarMatcher(compiler.compile(REGEX))
    before = matcher.allowed_mask()
    rejected = tokenizer.encode("12", add_special_tokens=False)[0]
    assert not before[rejected]
    assert not matcher.accept_token(rejected)
    assert not matcher.accept_token(VOCAB + 5)
    assert torch.equal(matcher.allowed_mask(), before)


def test_rollback_restores_masks(compiler, tokenizer):
    matcher = GrammarMatcher(compiler.compile(JSON))
    masks = [matcher.allowed_mask()]
    for token in tokenizer.encode('{"color": "green", "quantity": 42}', add_special_tokens=False):
        assert matcher.accept_token(token)
        masks.append(matcher.allowed_mask())
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()
    matcher.rollback(1)  # a rolled-back stop token un-terminates
    assert not matcher.is_terminated() and torch.equal(matcher.allowed_mask(), masks[-1])
    matcher.rollback(3)
    assert torch.equal(matcher.allowed_mask(), masks[-4])
    matcher.rollback(len(masks) - 4)
    assert torch.equal(matcher.allowed_mask(), masks[0])
    matcher.rollback(0)
    with pytest.raises(ValueError, match=r"num_tokens must be an integer in \[0, 0\]"):
        matcher.rollback(1)


def test_jump_forward(compiler, tokenizer):
    matcher = GrammarMatcher(compiler.compile(REGEX))
    _accept_text(matcher, tokenizer, "AB")
    forced = matcher.jump_forward_tokens()
    # "-" is forced, but xgrammar withholds a last token that a longer allowed
    # token (here "-1" ...) extends, so the list may be empty.
    assert "-".startswith(tokenizer.decode(forced))
    assert all(matcher.accept_token(t) for t in forced)

    matcher = GrammarMatcher(compiler.compile(JSON))
    forced = matcher.jump_forward_tokens()
    assert forced and '{"color": "'.startswith(tokenizer.decode(forced))
    assert matcher.jump_forward_tokens() == forced  # not accepted by asking
    assert all(matcher.accept_token(t) for t in forced)


def test_cache_returns_same_object(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, cache_size=2)
    first = compiler.compile(JSON)
    assert compiler.compile({"schema_type": "json", "schema": json.dumps(SCHEMA, indent=2)}) is first
    reordered = {"type": "object", "properties": dict(reversed(SCHEMA["properties"].items())), "required": SCHEMA["required"]}
    assert compiler.compile({"schema_type": "json", "schema": reordered}) is not first  # order is part of the grammar
    compiler.compile(REGEX)  # evicts the least recently used: the first JSON grammar
    assert compiler.cache_len == 2
    assert compiler.compile(JSON) is not first


def test_concurrent_compiles_share_one_grammar(compiler):
    so_args = {"schema_type": "regex", "schema": "[a-f0-9]{8}"}
    results, barrier = [], threading.Barrier(4)

    def work() -> None:
        barrier.wait()
        results.append(compiler.compile(so_args))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r is results[0] for r in results)


@pytest.mark.parametrize("so_args, message", [
    ({"schema_type": "regex", "schema": "[A-Z"}, r"invalid regex '\[A-Z': .*Unclosed '\['"),
    ({"schema_type": "regex", "schema": "a^b"}, "anchor '\\^' at position 1"),
    ({"schema_type": "json", "schema": {"type": "nonsense"}}, 'invalid JSON schema .*Unsupported type "nonsense"'),
    ({"schema_type": "ebnf", "schema": "root ::= ("}, r"invalid EBNF grammar 'root ::= \(': EBNF parser error at line 1, column 11"),
    ({"schema_type": "ebnf", "schema": 'start ::= "a"'}, 'root rule with name "root" is not found'),
    ({"schema_type": "json", "schema": '{"type": "object",'}, r"so_args\['schema'\] is not valid JSON"),
    ({"schema_type": "json", "schema": "[1, 2]"}, "must be an object or a boolean"),
    ({"schema_type": "xml", "schema": "x"}, "schema_type"),
    ({"schema_type": "regex", "schema": ""}, "non-empty string"),
])
def test_bad_inputs_raise_value_error(compiler, so_args, message):
    with pytest.raises(ValueError, match=message):
        compiler.compile(so_args)


def test_json_schema_with_nan_refused(compiler):
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        compiler.compile({"schema_type": "json", "schema": {"type": "number", "maximum": float("nan")}})


@pytest.mark.parametrize("kwargs, message", [
    ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    ({"vocab_size": VOCAB, "cache_size": -1}, "cache_size must be an integer >= 0"),
    ({"vocab_size": VOCAB, "stop_token_ids": []}, "stop_token_ids must be a non-empty list"),
    ({"vocab_size": VOCAB, "stop_token_ids": [VOCAB]}, r"ids in \[0, 49152\)"),
])
def test_compiler_arguments_validated(tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        GrammarCompiler(tokenizer, **kwargs)


def test_regex_dot_excludes_newline(compiler, tokenizer):
    matcher = GrammarMatcher(compiler.compile({"schema_type": "regex", "schema": "a.b"}))
    _accept_text(matcher, tokenizer, "a")
    assert not matcher.allowed_mask()[tokenizer.encode("\n", add_special_tokens=False)[0]]


def test_fill_masks_matches_single_masks(compiler, tokenizer):
    matchers = [GrammarMatcher(compiler.compile(so)) for so in (REGEX, JSON, EBNF)]
    _accept_text(matchers[1], tokenizer, '{"color": "re')
    batch = fill_masks([None, *matchers, None], VOCAB)
    assert batch.shape == (5, VOCAB) and batch.dtype == torch.bool
    assert batch[0].all() and batch[4].all()
    for row, matcher in zip(batch[1:4], matchers):
        assert torch.equal(row, matcher.allowed_mask())
    assert fill_masks([None, None], VOCAB) is None
    with pytest.raises(ValueError, match="vocab_size 49152, not 1000"):
        fill_masks(matchers, 1000)


def test_fill_masks_pooled_path_and_terminated_rows(compiler, tokenizer, walker):
    rng = random.Random(5)
    matchers = [GrammarMatcher(compiler.compile(JSON)) for _ in range(20)]
    for matcher in matchers[:-1]:
        for _ in range(rng.randrange(8)):
            allowed = matcher.allowed_mask()
            allowed[tokenizer.eos_token_id] = False
            if allowed.any():
                matcher.accept_token(rng.choice(allowed.nonzero().flatten().tolist()))
    walker.walk(matchers[-1], rng)
    batch = fill_masks(matchers, VOCAB)
    for row, matcher in zip(batch[:-1], matchers[:-1]):
        assert torch.equal(row, matcher.allowed_mask())
    assert batch[-1].all()  # a terminated matcher constrains nothing


@pytest.mark.parametrize("name, schema", SUPPORTED, ids=[name for name, _ in SUPPORTED])
def test_supported_json_schema_walks_validate(compiler, walker, name, schema):
    grammar = compiler.compile({"schema_type": "json", "schema": schema})
    rng = random.Random(name)
    for _ in range(8):
        text = walker.walk(GrammarMatcher(grammar), rng)
        jsonschema.validate(json.loads(text), schema, format_checker=FORMAT_CHECKER)


@pytest.mark.parametrize("name, schema, shape", APPROXIMATE, ids=[name for name, _, _ in APPROXIMATE])
def test_approximate_formats_have_the_shape(compiler, walker, name, schema, shape):
    grammar = compiler.compile({"schema_type": "json", "schema": schema})
    rng = random.Random(name)
    for _ in range(8):
        value = json.loads(walker.walk(GrammarMatcher(grammar), rng))
        assert re.fullmatch(shape, value), value


@pytest.mark.parametrize("name, schema, message", REFUSED, ids=[name for name, _, _ in REFUSED])
def test_unsupported_json_schema_refused(compiler, name, schema, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compiler.compile({"schema_type": "json", "schema": schema})
