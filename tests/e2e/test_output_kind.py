"""What each step hands back (SamplingParams.output_kind, vLLM's RequestOutputKind): everything so far, only what is
new, or nothing until the request finishes. The content a caller ends up with is the same in all three."""
import asyncio

import pytest

from deepinfer import SamplingParams
from deepinfer.engine.client import RequestStream
from deepinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput


def _run(engine, params: SamplingParams, prompts: list[str]) -> dict[str, list]:
    """Every output the engine hands back, per request id."""
    seen: dict[str, list] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{params.output_kind}-{i}", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id.split("-", 1)[1], []).append(out)
    return seen


def _joined(outputs: list) -> list[tuple]:
    """The deltas of one request put together: per sequence (text, token ids, logprobs, finish and stop reason)."""
    joined = []
    for index in range(len(outputs[-1].outputs)):
        parts = [o.outputs[index] for o in outputs]
        joined.append(("".join(p.text for p in parts), [t for p in parts for t in p.token_ids],
                       [lp for p in parts for lp in (p.logprobs or [])], parts[-1].finish_reason, parts[-1].stop_reason))
    return joined


def _final(output) -> list[tuple]:
    return [(s.text, s.token_ids, s.logprobs or [], s.finish_reason, s.stop_reason) for s in output.outputs]


@pytest.mark.parametrize("n", [1, 2])
def test_delta_and_final_only_give_what_cumulative_gives(smol, n):
    engine = smol.engine
    prompts = ["List three colors:", "The capital of France is", "Count to ten: one, two,"]
    base = dict(temperature=0.8, seq_seed=7, max_tokens=24, logprobs=2, stop=[" five"], n=n)
    cumulative = _run(engine, SamplingParams(**base), prompts)
    delta = _run(engine, SamplingParams(**base, output_kind="delta"), prompts)
    final = _run(engine, SamplingParams(**base, output_kind="final_only"), prompts)
    assert set(cumulative) == set(delta) == set(final) == {"0", "1", "2"}
    assert cumulative["2"][-1].outputs[0].stop_reason == " five"  # the held-back tail of a stop string is covered
    for key, outputs in cumulative.items():
        assert len(outputs) > 1 and outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        expected = _final(outputs[-1])
        assert _joined(delta[key]) == expected
        assert len(delta[key]) == len(outputs)  # a delta for every step the cumulative kind answered
        assert [o.finished for o in delta[key]] == [o.finished for o in outputs]
        assert len(final[key]) == 1 and final[key][0].finished and _final(final[key][0]) == expected
        assert final[key][0].metrics.first_token_time is not None


def test_generate_asks_the_engine_for_final_outputs_only(smol):
    engine = smol.engine
    handed: list = []
    step = engine.step

    def counting_step():
        outputs = step()
        handed.extend(outputs)
        return outputs

    engine.step = counting_step
    try:
        outs = smol.generate(["Hello", "The sky is"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                             use_tqdm=False)
    finally:
        del engine.step
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]
    assert len(handed) == 2 and all(o.finished for o in handed)
    again = _run(engine, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), ["Hello", "The sky is"])
    assert [_final(again[k][-1]) for k in ("0", "1")] == [_final(o) for o in outs]


def test_unknown_output_kind_is_refused():
    with pytest.raises(ValueError, match="output_kind must be one of"):
        SamplingParams(output_kind="streaming")


def _delta(text: str, tokens: list[int], finish: str | None = None) -> RequestOutput:
    seqs = [CompletionOutput(index=0, text=text, token_ids=tokens, finish_reason=finish, logprobs=[{t: -1.0}
                                                                                               for t in tokens])]
    return RequestOutput("r", None, [1, 2], seqs, finish is not None, RequestMetrics(arrival_time=0.0))


@pytest.mark.parametrize("delta", [False, True])
def test_a_slow_reader_gets_what_piled_up_as_one_output(delta):
    """Cumulative outputs: the newest stands for the pile. Deltas: the pile joined, nothing lost."""
    async def read() -> list[RequestOutput]:
        stream = RequestStream("r", delta=delta)
        for piece in (_delta("a", [5]), _delta("b", [6]), _delta("", [])):
            stream.put(piece)
        first = await stream.__anext__()
        stream.put(_delta("c", [7], "length"))
        return [first, await stream.__anext__()]

    first, last = asyncio.run(read())
    assert last.finished and last.outputs[0].text == "c"
    if delta:
        assert (first.outputs[0].text, first.outputs[0].token_ids) == ("ab", [5, 6])
        assert first.outputs[0].logprobs == [{5: -1.0}, {6: -1.0}] and not first.finished
    else:
        assert (first.outputs[0].text, first.outputs[0].token_ids) == ("", [])


def test_cli_generate_prints_the_text_generate_returns(smol, capsys):
    """`deepinfer generate` streams deltas to stdout: what it prints is the whole text."""
    from deepinfer.cli import main

    prompt = "The capital of France is"
    assert main(["generate", "--prompt", prompt, "--max-tokens", "16", "--temperature", "0", "--dtype", "float32",
                 "--kv-cache-memory", str(64 << 20)]) == 0
    printed = capsys.readouterr().out
    expected = smol.generate(prompt, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    assert printed == expected + "\n" and expected
