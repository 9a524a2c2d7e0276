"""Reference outputs of Hugging Face transformers for specdec's loaders and model.

Writes, under OUT, one folder per case: a small random model saved with save_pretrained
(config.json, model.safetensors) and reference.safetensors with what transformers computes for it:

  input_ids  int64 [1, S]   a sequence of random tokens
  logits     f32   [S, V]   the model's logits over it, in one forward
  hidden_states f32 [L+1, S, H] output_hidden_states of that forward: the input of each decoder
                            layer (the embeddings first), then the final normalised state
  prompt     int64 [P]      the first P tokens of input_ids
  greedy     int64 [64]     model.generate(prompt, do_sample=False, max_new_tokens=64)
  assisted   int64 [64]     the same with assistant_model=<the case's drafter>: transformers'
                            assisted generation

Each case's drafter, in the folder <case>_drafter, is the case's model with every weight moved by
noise (DRAFTER_NOISE of its own deviation): it agrees with the target often but not always, so
assisted generation both accepts and rejects drafts.

The weights are drawn so that logits are well spread (standard deviation about 4), as in trained
models, so that greedy decoding does not hinge on near ties. specdec's test
(tests/test_references.cpp) loads each folder and compares.

Usage: python hf_models.py OUT
"""
import json
import math
import os
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

GREEDY_TOKENS = 64
SEQUENCE = 48
PROMPT = 8
DRAFTER_NOISE = 0.2

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
              eos_token_id=2)

# name: (config class, model class, config fields)
CASES = {
    "llama_llama3_tied": (LlamaConfig, LlamaForCausalLM, dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
        rope_theta=500000.0, tie_word_embeddings=True)),
    "llama_linear_bias_untied": (LlamaConfig, LlamaForCausalLM, dict(
        rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True, tie_word_embeddings=False,
        num_hidden_layers=3)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    "mistral_window": (MistralConfig, MistralForCausalLM, dict(sliding_window=16, tie_word_embeddings=False)),
}


def spread_weights(model, seed):
    """Weights at a trained model's scale, logits with a deviation of about 4 so that greedy
    decoding does not hinge on near ties: projections N(0, 1/fan_in) (the two that write into the
    residual stream twice that), norms near 1, biases N(0, 0.5), and either unit embeddings with
    a classifier N(0, 16/hidden), or, tied, embeddings N(0, 1/hidden) with a final norm near 4
    (unit embeddings tied to the classifier make each token predict itself)."""
    generator = torch.Generator().manual_seed(seed)
    tied = model.config.tie_word_embeddings
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if name.endswith("norm.weight"):
                p.copy_((4.0 if tied and name == "model.norm.weight" else 1.0) * (1 + 0.1 * noise))
            elif name.endswith(".bias"):
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                p.copy_((1.0 / math.sqrt(p.shape[1]) if tied else 1.0) * noise)
            elif name == "lm_head.weight":
                p.copy_(4.0 / math.sqrt(p.shape[1]) * noise)
            else:
                scale = 2.0 if ("o_proj" in name or "down_proj" in name) else 1.0
                p.copy_(scale / math.sqrt(p.shape[1]) * noise)


def build(name, seed):
    config_class, model_class, fields = CASES[name]
    config = config_class(**{**COMMON, **fields})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_class(config).eval()
    spread_weights(model, seed)
    # Random models emit the end token like any other: generation runs its full length.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def perturbed(model, seed):
    """A copy of `model` with each weight moved by DRAFTER_NOISE of its deviation (norms: of 1)."""
    drafter = type(model)(model.config).eval()
    drafter.load_state_dict(model.state_dict())
    drafter.generation_config = model.generation_config
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            scale = 0.1 if name.endswith("norm.weight") else float(p.std())
            p.add_(DRAFTER_NOISE * scale * torch.randn(p.shape, generator=generator))
    return drafter


def main(out):
    transformers.utils.logging.disable_progress_bar()
    torch.use_deterministic_algorithms(True)
    os.makedirs(out, exist_ok=True)
    models = {name: build(name, 1000 + i) for i, name in enumerate(CASES)}
    drafters = {name: perturbed(model, 2000 + i) for i, (name, model) in enumerate(models.items())}
    ids = torch.randint(3, COMMON["vocab_size"], (1, SEQUENCE), generator=torch.Generator().manual_seed(7))
    for name, model in models.items():
        folder = os.path.join(out, name)
        model.save_pretrained(folder, safe_serialization=True)
        with torch.no_grad():
            output = model(ids, output_hidden_states=True)
            logits = output.logits[0].float().contiguous()
            hidden_states = torch.stack([h[0] for h in output.hidden_states]).float().contiguous()
            prompt = ids[:, :PROMPT]
            settings = dict(do_sample=False, max_new_tokens=GREEDY_TOKENS)
            greedy = model.generate(prompt, **settings)[0, PROMPT:].contiguous()
            tensors = {"input_ids": ids.contiguous(), "logits": logits, "hidden_states": hidden_states,
                       "prompt": prompt[0].clone(), "greedy": greedy}
            drafter = name + "_drafter"
            drafters[name].save_pretrained(os.path.join(out, drafter), safe_serialization=True)
            assisted = model.generate(prompt, assistant_model=drafters[name], **settings)
            tensors["assisted"] = assisted[0, PROMPT:].contiguous()
            if not torch.equal(tensors["assisted"], greedy):
                sys.exit(f"{name}: transformers' assisted generation differs from its greedy generation")
        save_file(tensors, os.path.join(folder, "reference.safetensors"))
        with open(os.path.join(folder, "reference.json"), "w") as f:
            json.dump({"drafter": drafter, "transformers": transformers.__version__, "torch": torch.__version__}, f)
    print(f"hf_models: {len(CASES)} cases written to {out} (transformers {transformers.__version__}, "
          f"torch {torch.__version__})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: hf_models.py OUT")
    main(sys.argv[1])
