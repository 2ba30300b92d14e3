"""Structured output with a regular expression: the answer is forced into the shape AB-123."""
from deepinfer import LLM, SamplingParams

llm = LLM()
params = SamplingParams(temperature=0, max_tokens=16,
                        so_args={"schema_type": "regex", "schema": r"[A-Z]{2}-[0-9]{3}"})
out = llm.chat([{"role": "user", "content": "Invent a product code for a blue kettle."}], params)
print(out[0].outputs[0].text)
