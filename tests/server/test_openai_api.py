"""The OpenAI routes, driven by the official `openai` client against a real server process."""
from __future__ import annotations

import asyncio
import uuid

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.server.metrics import VLLM_DASHBOARD_METRICS
from tests.server.conftest import API_KEY, MODEL

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def test_completion_text_usage_and_finish_reason(client, http):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    (choice,) = out.choices
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    assert choice.text and choice.finish_reason == "length"
    prompt_ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == 5
    assert out.usage.total_tokens == len(prompt_ids) + 5


def test_cached_tokens_report_the_prefix_cache_hit(client, http):
    prompt = f"{uuid.uuid4().hex}: " + "The quick brown fox jumps over the lazy dog. " * 5  # unique, ~60 tokens
    count = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # every full 16-token block of the prompt, leaving at least its last token to compute
    assert second.usage.prompt_tokens_details.cached_tokens == (count - 1) // 16 * 16 > 0


def test_streamed_completion_matches_the_whole_one(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_streamed_choices_put_together_are_the_whole_response(client):
    """n=2, seeded sampling, logprobs with echo and a stop string: each choice's streamed pieces (sent as deltas)
    joined give the whole response's text, logprobs and reasons; usage counts the same tokens."""
    args = dict(model=MODEL, prompt=[PROMPT, "Count: one, two,"], n=2, max_tokens=12, temperature=0.9, seed=3,
                logprobs=2, echo=True, stop=[" four"])
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    for choice in whole.choices:
        parts = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(p.text for p in parts) == choice.text
        assert [t for p in parts for t in p.logprobs.tokens] == choice.logprobs.tokens
        assert [t for p in parts for t in p.logprobs.token_logprobs] == choice.logprobs.token_logprobs
        assert [t for p in parts for t in p.logprobs.text_offset] == choice.logprobs.text_offset
        assert parts[-1].finish_reason == choice.finish_reason and parts[-1].stop_reason == choice.stop_reason
    assert len(whole.choices) == 4 and any(c.finish_reason == "stop" for c in whole.choices)
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_whole_and_streamed(client):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content and whole.usage.completion_tokens == 5
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_and_prompt_lists(client):
    out = client.completions.create(model=MODEL, prompt=[PROMPT, "Once upon a time"], n=2, max_tokens=3, seed=1,
                                extra_body={"ignore_eos": True})  # sampled: EOS may come early
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 4 * 3
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=3, stream=True)
    finished = {c.choices[0].index for c in chat if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_stop_string_cuts_the_text(client):
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    word = text.split()[1]  # a word after the first, so there is text before it
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[word])
    assert out.choices[0].text == text[: text.find(word)]
    assert out.choices[0].finish_reason == "stop"


def test_completion_logprobs_and_echo(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True)
    choice = out.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    generated = len(lp.tokens) - out.usage.prompt_tokens
    assert generated == 3 and lp.token_logprobs[0] is None  # the first prompt token has no logprob
    for token, logprob, top in list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))[-3:]:
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the most likely token
        assert len(top) >= 2
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                         temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_seed_reproduces_and_top_k_is_honoured(client):
    def sample(**kw):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=1.0, **kw).choices[0].text

    assert sample(seed=1234) == sample(seed=1234)
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    assert sample(extra_body={"top_k": 1}) == greedy


def test_logit_bias_forces_and_bans_tokens(client, http):
    """OpenAI's logit_bias, through the official client: +100 on one token makes greedy decoding repeat it; -100 on
    the greedy answer's first token makes it pick another; the bias leaves the raw logprobs as they were."""
    def complete(**kw):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1, **kw)
    plain = complete()
    (first,) = http.post("/tokenize", json={"prompt": plain.choices[0].logprobs.tokens[0]}).json()["tokens"]
    forced = http.post("/tokenize", json={"prompt": " blue"}).json()["tokens"]
    assert len(forced) == 1
    assert complete(logit_bias={str(forced[0]): 100}).choices[0].text == " blue" * 3
    banned = complete(logit_bias={str(first): -100})
    assert http.post("/tokenize", json={"prompt": banned.choices[0].logprobs.tokens[0]}).json()["tokens"] != [first]
    assert banned.choices[0].logprobs.token_logprobs[0] < plain.choices[0].logprobs.token_logprobs[0]  # raw: lower


def test_vllm_sampling_extensions_allowed_tokens_and_stop_string_kept(client, http):
    allowed = [http.post("/tokenize", json={"prompt": w}).json()["tokens"][0] for w in (" Paris", " London")]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=1.0, seed=3,
                                    extra_body={"allowed_token_ids": allowed})
    tokens = http.post("/tokenize", json={"prompt": out.choices[0].text}).json()["tokens"]
    assert set(tokens) <= set(allowed) and len(tokens) == 4
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    stop = plain.strip()[:3]
    kept = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.finish_reason == "stop" and kept.text.endswith(stop) and plain.startswith(kept.text)
    word = plain.split()[0]
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                       extra_body={"bad_words": [word]}).choices[0].text
    assert banned != plain and not banned.startswith(" " + word)


def test_chat_continues_the_final_assistant_message(client):
    start = "The three primary colors are"
    messages = [{"role": "user", "content": "Name the primary colors."}, {"role": "assistant", "content": start}]
    out = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=messages,
                                         extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert out.choices[0].message.content and out.usage.completion_tokens == 6
    new_turn = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=messages)
    assert out.usage.prompt_tokens < new_turn.usage.prompt_tokens  # no end of turn, no new assistant turn


def test_models_health_tokenize(client, http, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http.get("/health").status_code == 200
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == 1024
    assert PROMPT in http.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    chat_ids = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat_ids["count"] > 2


def test_metrics_are_prometheus_text_with_vllm_names(client, server):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    samples = server.metrics()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count"):
        assert name in samples, name
    assert samples["vllm:generation_tokens_total"] >= 2 and samples["vllm:e2e_request_latency_seconds_count"] >= 1
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert "length" in reasons


def test_metrics_carry_every_name_vllms_grafana_dashboard_reads(client, server):
    """vLLM's dashboard (examples/online_serving/prometheus_grafana/grafana.json) queries these; each must exist and,
    after a finished request, hold an observation."""
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=2, seed=3)
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    for name in VLLM_DASHBOARD_METRICS:
        if name.endswith("_total") or name.endswith("_perc") or name.startswith("vllm:num_requests"):
            assert name in samples, name
        else:  # a histogram: the dashboard reads _bucket, _sum and _count
            assert {f"{name}_bucket", f"{name}_sum", f"{name}_count"} <= samples.keys(), name
            assert sum(s.value for s in samples[f"{name}_count"]) >= 1, name
    assert max(s.value for s in samples["vllm:request_params_n_sum"]) >= 2


def test_sixteen_concurrent_streams_all_finish(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.completions.create(model=MODEL, prompt=f"Count to {i}:", max_tokens=4, stream=True,
                                                   extra_body={"ignore_eos": True})  # sampled: EOS may come early
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def main() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(one(c, i) for i in range(16)))

    results = asyncio.run(main())
    assert len(results) == 16 and all(reason == "length" for _, reason in results)
