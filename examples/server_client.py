"""Talk to `deepinfer serve` with the official openai client (start the server first:
`.venv/bin/deepinfer serve --port 8000`)."""
import sys

from openai import OpenAI

base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
client = OpenAI(base_url=base_url, api_key="none")
model = client.models.list().data[0].id
reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=32, temperature=0)
print(reply.choices[0].message.content)
for chunk in client.completions.create(model=model, prompt="Counting: one, two,", max_tokens=16, stream=True):
    print(chunk.choices[0].text, end="", flush=True)
print()
