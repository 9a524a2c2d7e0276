"""The Python half of scripts/gpu-check.sh: the models, transformers' side of the comparison, and
the summary table.

  gpu_check.py make DIR [--tiny]
      Writes under DIR, with save_pretrained (safetensors), a random-weight Llama target in
      bfloat16 (16 layers of width 2048, 32 heads, 8 key-value heads, feed-forward 8192,
      vocabulary 32000: 1.1 billion parameters), target/; its first two layers with its
      embeddings, final norm and head as a self-drafter, self_drafter/; a one-layer drafter with
      weights of its own (the target's first layer moved by noise), small_drafter/; and the prompt,
      prompt.json. --tiny makes the same shapes at toy size (width 64) for a CPU run.
      Random weights agree with nothing, so the target is built to be predictable from its first
      layers: layers after the second write into the residual stream at a tenth of the usual
      scale. The figures measure the machinery (launches, copies, graphs) at a realistic size and
      acceptance, not a trained drafter's quality.

  gpu_check.py transformers DIR [--device cuda] [--dtype bfloat16] [--gamma 4]
                                [--max-new-tokens 128] [--rounds 3]
      transformers' greedy generation and its assisted generation (assistant_model=, a constant
      gamma drafts per step) with each drafter, warmed up and alternated like specdec_gpu_bench;
      writes DIR/transformers.json.

  gpu_check.py table DIR [--checks FILE]
      Prints one table from DIR/specdec.json and DIR/transformers.json (and the CUDA tests'
      summary in FILE): tokens per second, speedup over the same library's autoregressive
      decoding, acceptance, tokens per target call, device-to-host copies per step, the cost
      model's speedup, and whether the greedy tokens equal transformers'. Where two sequences part,
      it says whether the target's two candidates there are a near-tie in the run's precision
      (see divergences(); the transformers step measures it, after specdec_gpu_bench has written
      specdec.json). Exits 1 when a specdec mode's tokens differ from specdec's autoregressive
      decoding other than at a near-tie.
"""
import argparse
import json
import math
import os
import sys
import time

FULL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048)
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
SELF_DRAFTER_LAYERS = 2
DEEP_LAYER_SCALE = 0.1
SMALL_DRAFTER_NOISE = 0.1
PROMPT_TOKENS = 32


def make(folder, tiny):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    import transformers
    transformers.utils.logging.disable_progress_bar()
    shape = TINY if tiny else FULL
    config = LlamaConfig(**shape, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    generator = torch.Generator().manual_seed(11)
    torch.manual_seed(11)
    with torch.device("cpu"):
        target = LlamaForCausalLM(config).eval()
    hidden = shape["hidden_size"]
    with torch.no_grad():
        # Weights at a trained model's scale, logits spread (deviation about 4) so that greedy
        # decoding does not hinge on near ties in bfloat16.
        for name, p in target.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            elif name == "lm_head.weight":
                p.copy_(4.0 / math.sqrt(hidden) * noise)
            else:
                scale = 1.0
                if "o_proj" in name or "down_proj" in name:
                    layer = int(name.split(".")[2])
                    scale = 2.0 if layer < SELF_DRAFTER_LAYERS else 2.0 * DEEP_LAYER_SCALE
                p.copy_(scale / math.sqrt(p.shape[1]) * noise)
    dtype = torch.float32 if tiny else torch.bfloat16
    os.makedirs(folder, exist_ok=True)

    def save(model, name):
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        model.to(dtype).save_pretrained(os.path.join(folder, name), safe_serialization=True)

    def first_layers(count, noise):
        c = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": count})
        drafter = LlamaForCausalLM(c).eval()
        state = {k: v for k, v in target.state_dict().items()
                 if not k.startswith("model.layers.") or int(k.split(".")[2]) < count}
        drafter.load_state_dict(state)
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if noise and ".layers." in name:
                    p.add_(noise * float(p.float().std()) * torch.randn(p.shape, generator=generator))
        return drafter

    save(first_layers(SELF_DRAFTER_LAYERS, 0.0), "self_drafter")
    save(first_layers(1, SMALL_DRAFTER_NOISE), "small_drafter")
    save(target, "target")
    prompt = torch.randint(3, shape["vocab_size"], (PROMPT_TOKENS,), generator=generator).tolist()
    with open(os.path.join(folder, "prompt.json"), "w") as f:
        json.dump({"prompt": prompt, "tiny": tiny}, f)
    print(f"gpu_check: models written to {folder} ({'tiny' if tiny else '1.1B-parameter'} target, "
          f"transformers {transformers.__version__}, torch {torch.__version__})")


def run_transformers(folder, device, dtype_name, gamma, new_tokens, rounds):
    import torch
    from transformers import LlamaForCausalLM
    import transformers
    transformers.utils.logging.disable_progress_bar()
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype_name]

    def load(name):
        model = LlamaForCausalLM.from_pretrained(os.path.join(folder, name), dtype=dtype,
                                                 attn_implementation="sdpa").to(device).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        return model

    target, drafters = load("target"), {"self_drafter": load("self_drafter"), "small_drafter": load("small_drafter")}
    for d in drafters.values():
        d.generation_config.num_assistant_tokens = gamma
        d.generation_config.num_assistant_tokens_schedule = "constant"
        d.generation_config.assistant_confidence_threshold = 0.0
    with open(os.path.join(folder, "prompt.json")) as f:
        prompt = torch.tensor([json.load(f)["prompt"]], device=device)
    settings = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    modes = {"autoregressive": None, **drafters}

    def generate(assistant):
        extra = {} if assistant is None else {"assistant_model": assistant}
        with torch.no_grad():
            return target.generate(prompt, **settings, **extra)[0, prompt.shape[1]:].tolist()

    def sync():
        if device != "cpu":
            torch.cuda.synchronize()

    results = {name: {"seconds": 0.0, "tokens": generate(assistant)} for name, assistant in modes.items()}
    for _ in range(rounds):
        for name, assistant in modes.items():
            sync()
            start = time.perf_counter()
            tokens = generate(assistant)
            sync()
            results[name]["seconds"] += time.perf_counter() - start
            if tokens != results[name]["tokens"]:
                sys.exit(f"transformers {name}: greedy tokens changed between runs")
    for r in results.values():
        r["tokens_per_second"] = len(r["tokens"]) * rounds / r["seconds"]
    out = {"device": device, "dtype": dtype_name, "gamma": gamma, "max_new_tokens": new_tokens, "rounds": rounds,
           "transformers": transformers.__version__, "torch": torch.__version__, "modes": results,
           "divergences": divergences(folder, target, prompt, results)}
    with open(os.path.join(folder, "transformers.json"), "w") as f:
        json.dump(out, f, indent=2)
    for name, r in results.items():
        print(f"transformers {name}: {r['tokens_per_second']:.1f} tokens/s")


def divergences(folder, target, prompt, results):
    """Where two greedy sequences part (a specdec mode against specdec's autoregressive decoding,
    specdec's against transformers', an assisted generation against transformers' greedy), the
    question is whether the target's two candidates are a tie within the precision it runs in. At
    the first differing position this scores the common prefix with the target in float32 (the
    margin between the two tokens' logits) and in the run's precision (the largest error of its
    logits against float32 there). A margin below twice that error is a near-tie: the two
    computations (one token, or several verified at once) may round either way."""
    import copy
    import torch
    pairs = []
    specdec_json = os.path.join(folder, "specdec.json")
    if os.path.exists(specdec_json):
        with open(specdec_json) as f:
            ours = json.load(f)["modes"]
        pairs += [(f"specdec {n}", m["tokens"], "specdec autoregressive", ours["autoregressive"]["tokens"])
                  for n, m in ours.items() if n != "autoregressive"]
        pairs.append(("specdec autoregressive", ours["autoregressive"]["tokens"], "transformers autoregressive",
                      results["autoregressive"]["tokens"]))
    pairs += [(f"transformers {n}", m["tokens"], "transformers autoregressive", results["autoregressive"]["tokens"])
              for n, m in results.items() if n != "autoregressive"]
    if not any(first_difference(a, b) is not None for _, a, _, b in pairs):
        return []
    exact = copy.deepcopy(target).float()
    out = []
    for name, tokens, reference, reference_tokens in pairs:
        at = first_difference(tokens, reference_tokens)
        if at is None or at >= min(len(tokens), len(reference_tokens)):
            continue
        ids = torch.cat([prompt, torch.tensor([tokens[:at]], dtype=prompt.dtype, device=prompt.device)], dim=1)
        with torch.no_grad():
            precise = exact(ids).logits[0, -1].float()
            rounded = target(ids).logits[0, -1].float()
        a, b = tokens[at], reference_tokens[at]
        out.append({"mode": name, "reference": reference, "position": at, "tokens": [a, b],
                    "float32_margin": abs(precise[a] - precise[b]).item(),
                    "precision_error": (rounded - precise).abs().max().item()})
    return out


def near_tie(d):
    return d["float32_margin"] < 2 * d["precision_error"]


def describe(d):
    kind = "a near-tie" if near_tie(d) else "NOT a tie"
    return (f"{kind}: float32 margin {d['float32_margin']:.3g}, {d['precision_error']:.3g} error of the run's "
            f"precision")


def theoretical_speedup(alpha, gamma, c):
    """Leviathan et al. (2023): (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1))."""
    if alpha >= 1.0:
        return (gamma + 1) / (gamma * c + 1)
    return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def table(folder, checks):
    with open(os.path.join(folder, "specdec.json")) as f:
        ours = json.load(f)
    with open(os.path.join(folder, "transformers.json")) as f:
        theirs = json.load(f)
    if ours["max_new_tokens"] != theirs["max_new_tokens"] or ours["gamma"] != theirs["gamma"]:
        sys.exit("gpu_check: specdec.json and transformers.json were made with different settings")
    gamma = ours["gamma"]
    base = ours["modes"]["autoregressive"]
    hf_base = theirs["modes"]["autoregressive"]
    print(f"specdec GPU check: {ours['device']}, {ours['dtype']}, gamma {gamma}, {ours['max_new_tokens']} new tokens, "
          f"{ours['rounds']} alternated rounds after a warm-up; libtorch {ours['torch']}, "
          f"transformers {theirs['transformers']} (torch {theirs['torch']})")
    if checks and os.path.exists(checks):
        with open(checks) as f:
            print("CUDA tests: " + f.read().strip())
    header = ("library", "mode", "tokens/s", "speedup", "acceptance", "tokens/call", "copies/step", "graph steps",
              "cost model", "same tokens as transformers")
    rows = []
    failed = False
    found = {(d["mode"], d["reference"]): d for d in theirs.get("divergences", [])}

    def why(mode, reference):
        d = found.get((mode, reference))
        return "" if d is None else f" ({describe(d)})"

    for name, m in ours["modes"].items():
        drafter = name.rsplit("_", 1)[0] if name.endswith(("_eager", "_graph")) else None
        model = ""
        if drafter is not None:
            eager = ours["modes"][drafter + "_eager"]
            c = eager["drafter_ms_per_call"] / max(eager["target_ms_per_call"], 1e-9)
            model = f"{theoretical_speedup(eager['acceptance'], gamma, c):.2f}x"
        hf_name = drafter if drafter is not None else "autoregressive"  # n-gram: its greedy tokens
        difference = first_difference(m["tokens"], theirs["modes"][hf_name]["tokens"])
        same = "yes" if difference is None else f"no (from token {difference})"
        if name == "autoregressive" and difference is not None:
            same = f"no (from token {difference}{why('specdec autoregressive', 'transformers autoregressive')})"
        own = first_difference(m["tokens"], base["tokens"])
        if own is not None:
            d = found.get((f"specdec {name}", "specdec autoregressive"))
            failed = failed or d is None or not near_tie(d)
            same += f"; differs from specdec autoregressive at token {own}{why(f'specdec {name}', 'specdec autoregressive')}"
        rows.append(("specdec", name, f"{m['tokens_per_second']:.1f}",
                     f"{m['tokens_per_second'] / base['tokens_per_second']:.2f}x", f"{m['acceptance']:.3f}",
                     f"{m['tokens_per_target_call']:.2f}", f"{m['copies_per_step']:.2f}",
                     f"{m['graph_steps']}/{m['steps']}", model, same))
    for name, m in theirs["modes"].items():
        own = first_difference(m["tokens"], hf_base["tokens"])
        rows.append(("transformers", name if name == "autoregressive" else name + "_assisted",
                     f"{m['tokens_per_second']:.1f}", f"{m['tokens_per_second'] / hf_base['tokens_per_second']:.2f}x",
                     "", "", "", "", "", "" if own is None else f"differs from its greedy at token {own}"
                     f"{why(f'transformers {name}', 'transformers autoregressive')}"))
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(v).ljust(w) for v, w in zip(r, widths)) + " |"
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))
    identical = all(first_difference(m["tokens"], theirs["modes"]["autoregressive"]["tokens"]) is None
                    for m in ours["modes"].values())
    print(f"greedy tokens identical to transformers: {'yes' if identical else 'no'}")
    if failed:
        sys.exit("gpu_check: a speculative mode's tokens differ from autoregressive decoding where the target's "
                 "two candidates are not a near-tie")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("make")
    p.add_argument("folder")
    p.add_argument("--tiny", action="store_true")
    p = sub.add_parser("transformers")
    p.add_argument("folder")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p = sub.add_parser("table")
    p.add_argument("folder")
    p.add_argument("--checks", default="")
    args = parser.parse_args()
    if args.command == "make":
        make(args.folder, args.tiny)
    elif args.command == "transformers":
        run_transformers(args.folder, args.device, args.dtype, args.gamma, args.max_new_tokens, args.rounds)
    else:
        table(args.folder, args.checks)


if __name__ == "__main__":
    main()
