"""Reference outputs of Medusa heads, as the Medusa project defines them, for specdec's loader.

The module definitions below are those of the Medusa project's medusa/model/medusa_model.py
(ResBlock: x + SiLU(Linear(x)); a head: medusa_num_layers ResBlocks, then a Linear to the
vocabulary without bias), rebuilt here with torch.nn so that the test needs no package beyond
torch. Writes, under OUT, one folder per case: config.json (medusa_num_heads, medusa_num_layers,
hidden_size, vocab_size), the heads' weights as medusa_lm_head.safetensors, and
reference.safetensors with

  hidden  f32 [N, H]      random hidden states
  logits  f32 [N, K, V]   every head's logits at each of them

Cases: "plain" (3 heads of one block, tensors named as the heads' own state_dict: 0.0.linear.weight)
and "prefixed" (2 heads of two blocks each, named as inside the whole model: medusa_head.0.0...).
The weights are random (the published code starts each block at zero, which would hide a block the
loader mixed up).

Usage: python medusa_heads.py OUT
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file
from torch import nn

HIDDEN = 32
VOCAB = 96
ROWS = 5


class ResBlock(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def heads(num_heads, num_layers):
    return nn.ModuleList([
        nn.Sequential(*[ResBlock(HIDDEN) for _ in range(num_layers)], nn.Linear(HIDDEN, VOCAB, bias=False))
        for _ in range(num_heads)])


def main(out):
    torch.manual_seed(11)
    cases = {"plain": (3, 1, ""), "prefixed": (2, 2, "medusa_head.")}
    for name, (num_heads, num_layers, prefix) in cases.items():
        folder = os.path.join(out, name)
        os.makedirs(folder, exist_ok=True)
        module = heads(num_heads, num_layers).eval()
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape) / (HIDDEN ** 0.5))
            hidden = torch.randn(ROWS, HIDDEN)
            logits = torch.stack([head(hidden) for head in module], dim=1).contiguous()
        save_file({prefix + k: v.contiguous() for k, v in module.state_dict().items()},
                  os.path.join(folder, "medusa_lm_head.safetensors"))
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({"medusa_num_heads": num_heads, "medusa_num_layers": num_layers, "hidden_size": HIDDEN,
                       "vocab_size": VOCAB, "base_model_name_or_path": "random"}, f)
        save_file({"hidden": hidden.contiguous(), "logits": logits}, os.path.join(folder, "reference.safetensors"))
    print(f"medusa_heads: {len(cases)} cases written to {out} (torch {torch.__version__})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: medusa_heads.py OUT")
    main(sys.argv[1])
