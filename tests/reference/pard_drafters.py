"""Reference outputs of parallel drafters (PARD) run by transformers, for specdec's loader and source.

A PARD drafter is a causal LM whose config.json names a mask token (pard_token; the PARD project's
trainer also writes spd_type "pard"). To draft K tokens after a context it is fed the context
followed by K - 1 copies of the mask token at the following positions, in one forward; the logits
at the context's last token and at each mask give the K drafts (greedy: the argmax of each row).
Writes, under OUT, one folder per case: the random model saved with save_pretrained, with
pard_token and spd_type in its config.json, and reference.safetensors with

  input_ids  int64 [1, P + K - 1]  a random context of P tokens, then K - 1 mask tokens
  logits     f32   [K, V]          transformers' logits at the last K positions of that forward
  drafts     int64 [K]             each row's argmax with the mask token's logit left out (a
                                   draft is never the mask)

Cases: a Qwen2 model (the family of the published PARD drafters for Qwen) and a Llama model with
untied embeddings, the mask a reserved id inside the vocabulary as in the published checkpoints.

Usage: python pard_drafters.py OUT
"""
import os
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hf_models import spread_weights

CONTEXT = 12
DRAFTS = 6
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
MASK = 250  # a reserved id, as the published checkpoints use one of their family's

CASES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    "llama_untied": (LlamaConfig, LlamaForCausalLM, dict(rope_theta=10000.0, tie_word_embeddings=False)),
}


def main(out):
    transformers.utils.logging.disable_progress_bar()
    torch.use_deterministic_algorithms(True)
    context = torch.randint(3, MASK, (1, CONTEXT), generator=torch.Generator().manual_seed(17))
    ids = torch.cat([context, torch.full((1, DRAFTS - 1), MASK)], dim=1)
    for i, (name, (config_class, model_class, fields)) in enumerate(CASES.items()):
        config = config_class(**{**COMMON, **fields})
        config._attn_implementation = "eager"
        config.pard_token = MASK
        config.spd_type = "pard"
        torch.manual_seed(3000 + i)
        model = model_class(config).eval()
        spread_weights(model, 3000 + i)
        folder = os.path.join(out, name)
        model.save_pretrained(folder, safe_serialization=True)
        with torch.no_grad():
            logits = model(ids).logits[0, -DRAFTS:].float().contiguous()
        proposable = logits.clone()
        proposable[:, MASK] = float("-inf")
        save_file({"input_ids": ids.contiguous(), "logits": logits, "drafts": proposable.argmax(-1).contiguous()},
                  os.path.join(folder, "reference.safetensors"))
    print(f"pard_drafters: {len(CASES)} cases written to {out} (transformers {transformers.__version__}, "
          f"torch {torch.__version__})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: pard_drafters.py OUT")
    main(sys.argv[1])
