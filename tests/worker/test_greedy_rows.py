"""A step of plain greedy rows takes the argmax straight away (runner._sample) instead of going through the sampler:
the same tokens, logprobs and finish reasons as through the sampler, for plain greedy requests beside requests the
sampler must handle (min_tokens holding back EOS, logprobs, penalties, seeded sampling, n-gram drafts)."""
import pytest
import transformers

from deepinfer import SamplingParams
from deepinfer.llm import LLM
from deepinfer.worker.request_state import WorkerRequest

from ..models.hf_reference import save_tiny

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PROMPTS = [[5, 17, 99, 3], list(range(1, 30)), [7, 7, 7, 7, 7, 7], list(range(100, 120))]


def params_for(mixed: bool) -> list[SamplingParams]:
    if not mixed:
        return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 31, 12, 40)]
    return [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=30, min_tokens=10),
            SamplingParams(temperature=0, max_tokens=25, logprobs=2, repetition_penalty=1.2, ignore_eos=True),
            SamplingParams(temperature=0.8, seq_seed=5, max_tokens=28, ignore_eos=True)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny(transformers.LlamaForCausalLM,
              transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                       tie_word_embeddings=True), path)
    return str(path)


def run(llm: LLM, mixed: bool) -> list:
    outs = llm.generate(PROMPTS, params_for(mixed), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("spec", [{}, dict(speculative_method="ngram", num_speculative_tokens=3)])
@pytest.mark.parametrize("mixed", [False, True])
def test_same_outputs_with_the_argmax_taken_straight_away(tiny, monkeypatch, mixed, spec):
    llm = LLM(tiny, quantization="int8", kv_cache_memory=8 << 20, **spec)
    taken = [0]
    argmax_only = WorkerRequest.argmax_only

    def counted(self):
        answer = argmax_only.fget(self)
        taken[0] += answer
        return answer

    monkeypatch.setattr(WorkerRequest, "argmax_only", property(counted))
    direct = run(llm, mixed)
    assert taken[0] > 0  # plain greedy rows seen (with plain rows only, every step takes the argmax straight away)
    monkeypatch.setattr(WorkerRequest, "argmax_only", property(lambda self: False))
    assert run(llm, mixed) == direct
    llm.engine.close()
