"""Structured output with an EBNF grammar: the answer is exactly "yes" or "no"."""
from deepinfer import LLM, SamplingParams

GRAMMAR = 'root ::= "yes" | "no"'
llm = LLM()
params = SamplingParams(temperature=0, max_tokens=4, so_args={"schema_type": "ebnf", "schema": GRAMMAR})
out = llm.chat([{"role": "user", "content": "Is the sun a star? Answer yes or no."}], params)
print(out[0].outputs[0].text)
