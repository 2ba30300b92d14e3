"""Offline batch generation: several prompts at once, greedy and seeded sampling."""
from deepinfer import LLM, SamplingParams

llm = LLM()  # the bundled SmolLM2-135M-Instruct, computed on its GGUF blocks
prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
for out in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24)):
    print(repr(out.prompt), "->", repr(out.outputs[0].text))
sampled = llm.generate(prompts[:1], SamplingParams(temperature=0.8, top_p=0.9, seq_seed=7, max_tokens=24, n=2))
for seq in sampled[0].outputs:
    print("sample", seq.index, repr(seq.text))
