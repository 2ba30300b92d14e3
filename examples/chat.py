"""A multi-turn chat with the model's chat template; the second turn reuses the first turn's KV (prefix cache)."""
from deepinfer import LLM, SamplingParams

llm = LLM()
params = SamplingParams(temperature=0, max_tokens=64)
messages = [{"role": "user", "content": "Name three colours."}]
first = llm.chat(messages, params)[0]
print("assistant:", first.outputs[0].text)
messages += [{"role": "assistant", "content": first.outputs[0].text}, {"role": "user", "content": "Now one more."}]
second = llm.chat(messages, params)[0]
print("assistant:", second.outputs[0].text, f"(prompt tokens from the cache: {second.num_cached_tokens})")
