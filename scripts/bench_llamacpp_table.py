#!/usr/bin/env python3
"""Prints the table of scripts/bench-llamacpp.sh from its results folder: the best of the rounds
for every figure of specdec (bench_cpu_target's JSON) and of llama.cpp (llama-bench's JSON and
llama-speculative-simple's logs).

    bench_llamacpp_table.py RESULTS_FOLDER THREADS"""
import glob
import json
import os
import re
import statistics
import sys

FORMATS = {"fp32": (1, "f32"), "bf16": (2, "BF16"), "8-bit": (3, "Q8_0")}  # specdec format, GGUF type


def specdec_runs(folder, model):
    """name -> list of benchmark entries (one per round)."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(folder, f"specdec-{model}-*.json"))):
        try:
            with open(path) as f:
                entries = json.load(f)["benchmarks"]
        except (OSError, ValueError, KeyError):
            continue  # a run that did not finish
        for entry in entries:
            if entry.get("error_occurred"):
                continue
            name = entry["name"].split("/iterations")[0]
            runs.setdefault(name, []).append(entry)
    return runs


def best(entries, key, smaller=False):
    values = [e[key] for e in entries if key in e]
    if not values:
        return None
    return min(values) if smaller else max(values)


def llama_bench(folder, model, gguf_type):
    """(tokens/s of generation, {k: seconds of a k-token forward}) over the rounds, best."""
    generation, forward = None, {}
    for path in sorted(glob.glob(os.path.join(folder, f"llamabench-{model}-{gguf_type}-*.json"))):
        try:
            with open(path) as f:
                rows = json.load(f)
        except (OSError, json.JSONDecodeError):
            continue
        for row in rows:
            if row.get("n_gen", 0) > 0 and row.get("n_prompt", 0) == 0:
                generation = max(generation or 0, row["avg_ts"])
            elif row.get("n_prompt", 0) > 0 and row.get("n_gen", 0) == 0:
                k = row["n_prompt"]
                seconds = k / row["avg_ts"]
                forward[k] = min(forward.get(k, seconds), seconds)
    return generation, forward


def llama_speculative(folder, gguf_type):
    """{n_max: (tokens/s, tokens per target call)} best over the rounds; None where it failed."""
    result = {}
    for path in sorted(glob.glob(os.path.join(folder, f"speculative-{gguf_type}-*-*.log"))):
        n = int(path.split("-")[-2])
        text = open(path, errors="replace").read()
        speed = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", text)
        accept = re.search(r"n_accept\s*=\s*(\d+)", text)
        if not speed or not accept:
            result.setdefault(n, None)
            continue
        predicted, accepted = int(speed.group(1)), int(accept.group(1))
        per_call = predicted / max(1, predicted - accepted)
        current = result.get(n)
        tokens_per_second = float(speed.group(3))
        if current is None or tokens_per_second > current[0]:
            result[n] = (tokens_per_second, per_call)
    return result


def pairs(folder, gguf_type):
    """[(specdec tok/s, llama.cpp tok/s)] of the alternated autoregressive pairs of one precision
    (pair-*.json), the pairs where both sides finished."""
    result = []
    for path in sorted(glob.glob(os.path.join(folder, f"pair-specdec-{gguf_type}-*.json"))):
        pair = path.rsplit("-", 1)[1][:-len(".json")]
        try:
            with open(path) as f:
                entries = [e for e in json.load(f)["benchmarks"] if not e.get("error_occurred")]
            with open(os.path.join(folder, f"pair-llamabench-{gguf_type}-{pair}.json")) as f:
                rows = [r for r in json.load(f) if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0]
        except (OSError, ValueError, KeyError):
            continue
        if entries and rows:
            result.append((entries[0]["tokens_per_second"], rows[0]["avg_ts"]))
    return result


def print_pairs(folder):
    rows = [(precision, pairs(folder, gguf_type)) for precision, (_, gguf_type) in FORMATS.items()]
    if not any(found for _, found in rows):
        return
    print("\nautoregressive decoding in alternated pairs (one precision at a time, the two sides back to back, "
          "the order reversed every other pair):\n")
    print("| precision | pairs | specdec best tok/s | llama.cpp best tok/s | ratio of the bests | "
          "median ratio within a pair | ratios within the pairs |")
    print("|---|---|---|---|---|---|---|")
    for precision, found in rows:
        if not found:
            continue
        ratios = sorted(mine / theirs for mine, theirs in found)
        middle = len(ratios) // 2
        median = ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2
        mine, theirs = max(m for m, _ in found), max(t for _, t in found)
        listed = ", ".join(fmt(mine_pair / theirs_pair) for mine_pair, theirs_pair in found)
        print(f"| {precision} | {len(found)} | {fmt(mine)} | {fmt(theirs)} | {fmt(mine / theirs)} | {fmt(median)} | "
              f"{listed} |")


def fmt(value, digits=2):
    return "—" if value is None else f"{value:.{digits}f}"


def main():
    folder, threads = sys.argv[1], sys.argv[2]
    ours = specdec_runs(folder, "w1b")
    if not ours and not glob.glob(os.path.join(folder, "llamabench-*.json")):  # ROUNDS=0: the pairs alone
        print_pairs(folder)
        return
    ours64 = specdec_runs(folder, "random64")
    floor = best(ours.get("BM_Floor", []), "read_gb_per_s")
    print(f"specdec beside llama.cpp: stories260K widened to 1.04B parameters, llama2xs drafting, {threads} threads, "
          f"greedy; best of the rounds. Memory floor: {fmt(floor, 1)} GB/s read (1 GiB, one stream per thread).\n")
    print("| row | specdec tok/s | llama.cpp tok/s | ratio | specdec of floor | llama.cpp of floor |")
    print("|---|---|---|---|---|---|")
    forward_tables = []
    for precision, (format_id, gguf_type) in FORMATS.items():
        forward = ours.get(f"BM_Forward/{format_id}/1", [])
        gigabytes = None
        if forward:
            entry = forward[0]
            gigabytes = entry["weight_gb_per_s"] * entry["ms"] / 1e3  # weight bytes of a forward
        generation, llama_forward = llama_bench(folder, "w1b", gguf_type)
        mine = best(ours.get(f"BM_Generate/{format_id}/0", []), "tokens_per_second")
        of_floor = (lambda rate: None if rate is None or gigabytes is None or floor is None else rate * gigabytes / floor)
        ratio = None if mine is None or not generation else mine / generation
        print(f"| autoregressive, {precision} | {fmt(mine)} | {fmt(generation)} | {fmt(ratio)} | {fmt(of_floor(mine))} | "
              f"{fmt(of_floor(generation))} |")
        mine64 = best(ours64.get(f"BM_Generate/{format_id}/0", []), "tokens_per_second")
        generation64, _ = llama_bench(folder, "random64", gguf_type)
        ratio64 = None if mine64 is None or not generation64 else mine64 / generation64
        print(f"| autoregressive, {precision}, random weights of head size 64 | {fmt(mine64)} | {fmt(generation64)} | "
              f"{fmt(ratio64)} | | |")
        speculative = {}
        for name, entries in ours.items():
            match = re.fullmatch(rf"BM_Generate/{format_id}/(\d+)", name)
            if match and int(match.group(1)) > 0:
                speculative[int(match.group(1))] = (best(entries, "tokens_per_second"),
                                                    best(entries, "tokens_per_target_call"))
        mine_gamma = max(speculative, key=lambda g: speculative[g][0] or 0) if speculative else None
        theirs = llama_speculative(folder, gguf_type)
        working = {n: v for n, v in theirs.items() if v is not None}
        their_n = max(working, key=lambda n: working[n][0]) if working else None
        mine_best = speculative[mine_gamma][0] if mine_gamma else None
        their_best = working[their_n][0] if their_n else None
        ratio = None if mine_best is None or their_best is None else mine_best / their_best
        failed = "" if working or not theirs else " (llama.cpp's speculative example failed: see its logs)"
        print(f"| speculative, {precision}, best gamma (specdec {mine_gamma}, "
              f"{fmt(speculative[mine_gamma][1]) if mine_gamma else '—'} tokens/call; llama.cpp n_max {their_n}, "
              f"{fmt(working[their_n][1]) if their_n else '—'} tokens/call){failed} | {fmt(mine_best)} | "
              f"{fmt(their_best)} | {fmt(ratio)} | | |")
        ours_k = {}
        for k in range(1, 10):
            ms = best(ours.get(f"BM_Forward/{format_id}/{k}", []), "ms", smaller=True)
            if ms is not None:
                ours_k[k] = ms / 1e3
        # Each round's median of t(k) over the one-token forward run just before it; the median
        # over the rounds.
        paired = {}
        for k in range(2, 10):
            values = [e["paired_ratio"] for e in ours.get(f"BM_Forward/{format_id}/{k}", []) if "paired_ratio" in e]
            if values:
                paired[k] = statistics.median(values)
        forward_tables.append((precision, ours_k, llama_forward, paired))
    unpacked = {k: best(ours.get(f"BM_Forward/0/{k}", []), "ms", smaller=True) for k in range(1, 10)}
    print("\nt(k)/t(1), the cost of a forward of k new tokens over one (k - 1 drafts verified), and t(1) in ms:\n")
    print("| precision | side | t(1) ms | " + " | ".join(f"k={k}" for k in range(2, 10)) + " |")
    print("|---|---|---|" + "---|" * 8)
    for precision, ours_k, theirs_k, paired in forward_tables:
        for side, table in (("specdec", ours_k), ("llama.cpp", theirs_k)):
            if 1 not in table:
                continue
            cells = " | ".join(fmt(table[k] / table[1]) if k in table else "—" for k in range(2, 10))
            print(f"| {precision} | {side} | {fmt(table[1] * 1e3, 1)} | {cells} |")
        if paired:
            cells = " | ".join(fmt(paired[k]) if k in paired else "—" for k in range(2, 10))
            print(f"| {precision} | specdec, within pairs (t(k) over the t(1) run just before it) | | {cells} |")
    if unpacked.get(1):
        cells = " | ".join(fmt(unpacked[k] / unpacked[1]) if unpacked.get(k) else "—" for k in range(2, 10))
        print(f"| fp32 | specdec, unpacked (oneDNN/BLAS) | {fmt(unpacked[1], 1)} | {cells} |")
    print_bounds(ours, floor)
    print_pairs(folder)


def print_bounds(ours, floor):
    """specdec's forwards of 1 and 8 tokens beside what bounds them on this machine: the memory
    (weight bytes over the floor's rate) and the arithmetic (k x weights multiply-adds over
    BM_Ceiling's rate with the loops' instruction)."""
    ceilings = {"fp32": best(ours.get("BM_Ceiling", []), "fp32_gmac_per_s"),
                "bf16": best(ours.get("BM_Ceiling", []), "bf16_gmac_per_s"),
                "8-bit": best(ours.get("BM_Ceiling", []), "int16_gmac_per_s")}
    if floor is None or not ceilings["fp32"]:  # 0: a CPU without AVX-512, none measured
        return
    print(f"\nspecdec's forwards beside this machine's bounds: the memory (weight bytes over the floor's "
          f"{fmt(floor, 1)} GB/s) and the arithmetic (k x weights multiply-adds at {fmt(ceilings['fp32'], 1)} "
          f"G/s by fp32 multiply-adds, " +
          (f"{fmt(ceilings['bf16'], 1)} G/s by bf16 dot products; " if ceilings["bf16"] else "bf16 widened to fp32; ") +
          (f"{fmt(ceilings['8-bit'], 1)} G/s by int16 pair products for int8)" if ceilings["8-bit"]
           else "int8 at the fp32 rate)") + ":\n")
    print("| precision | weights GB | memory bound ms | t(1) ms | t(8) ms | arithmetic bound of t(8) ms |")
    print("|---|---|---|---|---|---|")
    for precision, (format_id, _) in FORMATS.items():
        one = ours.get(f"BM_Forward/{format_id}/1", [])
        eight = best(ours.get(f"BM_Forward/{format_id}/8", []), "ms", smaller=True)
        if not one or eight is None:
            continue
        gigabytes = one[0]["weight_gb_per_s"] * one[0]["ms"] / 1e3
        weights = gigabytes * 1e9 / {"fp32": 4, "bf16": 2, "8-bit": 1}[precision]
        ceiling = ceilings[precision] if precision != "fp32" and ceilings[precision] else ceilings["fp32"]
        memory_ms = 1e3 * gigabytes / floor
        print(f"| {precision} | {fmt(gigabytes)} | {fmt(memory_ms, 1)} | {fmt(best(one, 'ms', smaller=True), 1)} | "
              f"{fmt(eight, 1)} | {fmt(1e3 * 8 * weights / (ceiling * 1e9), 1)} |")


if __name__ == "__main__":
    main()
