"""transformers generate on one device: B prompts of P random tokens, exactly O new tokens, greedy; tokens/s.

    python benchmarks/gpu/hf_generate.py /tmp/smol-rand cuda float32 hf.jsonl 1,16,64,256
"""
import json
import sys
import time

import torch
import transformers

path, device, dtype, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
batches = [int(b) for b in sys.argv[5].split(",")]
P, O = 128, 128
model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
g = torch.Generator().manual_seed(0)
rows = []
for b in batches:
    ids = torch.randint(1000, 20000, (b, P), generator=g).to(device)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=O, min_new_tokens=O, do_sample=False, pad_token_id=2)
    with torch.inference_mode():
        model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        res = model.generate(ids, **kw)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    assert res.shape[1] == P + O
    rows.append({"engine": "transformers", "dtype": dtype, "batch": b, "total_tok_s": b * O / wall, "wall_s": wall})
    print(json.dumps(rows[-1]), flush=True)
with open(out, "a") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
