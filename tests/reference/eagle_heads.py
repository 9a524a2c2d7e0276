"""Reference outputs of EAGLE heads, as the EAGLE project and vLLM's speculators define them, for
specdec's loader (include/specdec/io/eagle.hpp).

The heads are rebuilt here from transformers' Llama layers (LlamaRMSNorm, LlamaMLP,
LlamaRotaryEmbedding, apply_rotary_pos_emb, repeat_kv) as the published module definitions
compose them:

  EAGLE-3: fc over three target hidden states; one decoder layer whose attention reads
    [input_layernorm(embedding); hidden_norm(h)] and adds to h (to hidden_norm(h) with
    norm_before_residual); norm; lm_head over a draft vocabulary, draft id d being target id
    d + d2t[d]. Later draft positions read the layer's own output as h.
  EAGLE-1: fc (with bias) over [embedding; feature]; the layer without its input norm; the
    target's classifier on the layer's output.

Writes, under OUT, one folder per case holding the head as published (config.json,
model.safetensors) and reference.safetensors with

  target    i64 [3]        the target's hidden size, vocabulary and layer count
  embedding f32 [V, Ht]    the target's embedding (used when the head has none)
  classifier f32 [V, Ht]   the target's classifier (EAGLE-1)
  features  f32 [N, F]     random target hidden states, F = 3 Ht (EAGLE-3) or Ht (EAGLE-1)
  ids       i64 [N]        the tokens each position reads (the token after its feature)
  outputs   f32 [N, H]     the layer's outputs over positions 0..N-1
  logits    f32 [N, Vd]    the head's logits there (draft vocabulary)
  drafts    i64 [K]        greedy drafts (target ids) continuing from the last position, each
                           later position reading the draft before and the layer's last output

Cases: "eagle3" (the EAGLE project's layout: midlayer., fc without bias, the target's embedding,
default target layers), "speculators" (speculators_model_type eagle3: layers.0., fc with bias,
its own embedding, norm_before_residual, target_hidden_size differing from hidden_size, grouped
queries, llama3 rope scaling, layer ids in config.json) and "eagle1".

Usage: python eagle_heads.py OUT
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding,
                                                      apply_rotary_pos_emb, repeat_kv)

VOCAB = 96
LAYERS = 6
ROWS = 7
DRAFTS = 4


class Attention(nn.Module):
    def __init__(self, config, inputs):
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // self.heads
        self.q_proj = nn.Linear(inputs, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(inputs, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(inputs, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, past):
        t = x.shape[1]
        q = self.q_proj(x).view(1, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(1, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(1, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        present = (k, v)
        groups = self.heads // self.kv_heads
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        scores = q @ k.transpose(2, 3) / self.head_dim ** 0.5
        seen = k.shape[2] - t
        mask = torch.full((t, k.shape[2]), float("-inf")).triu(seen + 1)
        weights = torch.softmax(scores + mask, dim=-1, dtype=torch.float32)
        out = (weights @ v).transpose(1, 2).reshape(1, t, self.heads * self.head_dim)
        return self.o_proj(out), present


class Head(nn.Module):
    """One EAGLE head: the module names are those of the published checkpoints."""

    def __init__(self, config, eagle3, target_hidden, draft_vocab, fc_bias, norm_before_residual, own_embedding):
        super().__init__()
        h = config.hidden_size
        self.eagle3 = eagle3
        self.norm_before_residual = norm_before_residual
        self.embed_tokens = nn.Embedding(VOCAB, h) if own_embedding else None
        self.fc = nn.Linear(3 * target_hidden if eagle3 else 2 * h, h, bias=fc_bias)
        layer = nn.Module()
        if eagle3:
            layer.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
            layer.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        layer.self_attn = Attention(config, 2 * h if eagle3 else h)
        layer.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        layer.mlp = LlamaMLP(config)
        self.layer = layer
        self.rotary = LlamaRotaryEmbedding(config=config)
        if eagle3:
            self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
            self.lm_head = nn.Linear(h, draft_vocab, bias=False)

    def run(self, embedded, hidden, start, past):
        """The layer over positions start.. with hidden states `hidden` (fc'd where it must be)."""
        layer = self.layer
        positions = torch.arange(start, start + embedded.shape[1]).unsqueeze(0)
        cos, sin = self.rotary(embedded, positions)
        if self.eagle3:
            normed = layer.hidden_norm(hidden)
            residual = normed if self.norm_before_residual else hidden
            x = torch.cat([layer.input_layernorm(embedded), normed], dim=-1)
        else:
            residual = x = self.fc(torch.cat([embedded, hidden], dim=-1))
        attended, present = layer.self_attn(x, cos, sin, past)
        h = residual + attended
        return h + layer.mlp(layer.post_attention_layernorm(h)), present


def randomise(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape) / max(p.shape[-1], 1) ** 0.5 * (1.5 if p.dim() == 2 else 1.0))
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape))


def make_case(folder, name, eagle3, hidden, target_hidden, heads, kv_heads, draft_vocab, fc_bias, norm_before_residual,
              own_embedding, layer_ids, rope, speculators):
    os.makedirs(folder, exist_ok=True)
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    if rope is not None:
        rope_parameters = dict(rope)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden + 8, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, num_hidden_layers=1, vocab_size=VOCAB, rms_norm_eps=1e-5,
                         max_position_embeddings=64, rope_parameters=rope_parameters, hidden_act="silu")
    head = Head(config, eagle3, target_hidden, draft_vocab, fc_bias, norm_before_residual, own_embedding).eval()
    randomise(head)
    embedding = torch.randn(VOCAB, target_hidden)
    classifier = torch.randn(VOCAB, target_hidden) / target_hidden ** 0.5
    embed = head.embed_tokens.weight if own_embedding else embedding
    d2t = None
    if eagle3:
        chosen = torch.randperm(VOCAB)[:draft_vocab].sort().values
        d2t = chosen - torch.arange(draft_vocab)
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[chosen] = True

    def logits_of(out):
        if eagle3:
            return head.lm_head(head.norm(out))
        return out @ classifier.T

    def to_target(draft):
        return draft + d2t[draft] if eagle3 else draft

    with torch.no_grad():
        width = 3 * target_hidden if eagle3 else target_hidden
        features = torch.randn(ROWS, width)
        ids = torch.randint(0, VOCAB, (ROWS,))
        fused = head.fc(features) if eagle3 else features
        out, past = head.run(embed[ids].unsqueeze(0), fused.unsqueeze(0), 0, None)
        outputs = out[0]
        logits = logits_of(outputs)
        drafts = []
        last = outputs[-1:].unsqueeze(0)
        position = ROWS
        token = to_target(logits[-1].argmax())
        drafts.append(int(token))
        for _ in range(DRAFTS - 1):
            last, past = head.run(embed[token].view(1, 1, -1), last, position, past)
            position += 1
            token = to_target(logits_of(last[0, -1]).argmax())
            drafts.append(int(token))

    layer_prefix = "layers.0." if (speculators or not eagle3) else "midlayer."
    tensors = {}
    for key, value in head.state_dict().items():
        if key.startswith("rotary."):
            continue
        key = key.replace("layer.", layer_prefix, 1) if key.startswith("layer.") else key
        tensors[key] = value.contiguous()
    if eagle3:
        tensors["d2t"] = d2t.contiguous()
        tensors["t2d"] = t2d.contiguous()
    save_file(tensors, os.path.join(folder, "model.safetensors"))

    layer_config = {"hidden_size": hidden, "intermediate_size": 2 * hidden + 8, "num_attention_heads": heads,
                    "num_key_value_heads": kv_heads, "num_hidden_layers": 1, "vocab_size": VOCAB,
                    "rms_norm_eps": 1e-5, "max_position_embeddings": 64, "hidden_act": "silu", "model_type": "llama",
                    "rope_theta": rope_parameters["rope_theta"]}
    if rope is not None:
        layer_config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if speculators:
        config_json = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                       "transformer_layer_config": layer_config, "draft_vocab_size": draft_vocab,
                       "norm_before_residual": norm_before_residual, "target_hidden_size": target_hidden,
                       "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "random"}}}
    else:
        config_json = dict(layer_config, architectures=["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLM"])
        if eagle3:
            config_json["draft_vocab_size"] = draft_vocab
    if layer_ids is not None:
        config_json["eagle_aux_hidden_state_layer_ids"] = layer_ids
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config_json, f, indent=1)
    save_file({"target": torch.tensor([target_hidden, VOCAB, LAYERS]), "embedding": embedding.contiguous(),
               "classifier": classifier.contiguous(), "features": features.contiguous(), "ids": ids.contiguous(),
               "outputs": outputs.contiguous(), "logits": logits.contiguous(), "drafts": torch.tensor(drafts)},
              os.path.join(folder, "reference.safetensors"))
    return name


def main(out):
    torch.manual_seed(31)
    cases = [
        make_case(os.path.join(out, "eagle3"), "eagle3", True, 32, 32, 4, 4, 40, False, False, False, None, None,
                  False),
        make_case(os.path.join(out, "speculators"), "speculators", True, 32, 24, 4, 2, 50, True, True, True,
                  [1, 3, 5], {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}, True),
        make_case(os.path.join(out, "eagle1"), "eagle1", False, 32, 32, 4, 2, VOCAB, True, False, False, None, None,
                  False),
    ]
    print(f"eagle_heads: {len(cases)} cases written to {out} (torch {torch.__version__})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: eagle_heads.py OUT")
    main(sys.argv[1])
