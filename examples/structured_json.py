"""Structured output with a JSON schema: an object with a colour and a quantity, always valid JSON."""
import json

from deepinfer import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                   "quantity": {"type": "integer", "minimum": 1, "maximum": 10}},
    "required": ["colour", "quantity"],
    "additionalProperties": False,
}
llm = LLM()
params = SamplingParams(temperature=0, max_tokens=48, so_args={"schema_type": "json", "schema": SCHEMA})
out = llm.chat([{"role": "user", "content": "Order some paint."}], params)
order = json.loads(out[0].outputs[0].text)
print(json.dumps(order, sort_keys=True))
