"""A SmolLM2-135M-shaped Llama with random weights (the real weights exceed the device transfer limit).

    python benchmarks/gpu/random_model.py <folder with SmolLM2 config.json and tokenizer files> /tmp/smol-rand
"""
import shutil
import sys

import torch
import transformers

src, dst = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
config = transformers.AutoConfig.from_pretrained(src)
model = transformers.LlamaForCausalLM(config).to(torch.float32)
model.save_pretrained(dst)
for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
    shutil.copy(f"{src}/{name}", f"{dst}/{name}")
print("saved", dst, sum(p.numel() for p in model.parameters()))
