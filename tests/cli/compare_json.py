#!/usr/bin/env python3
"""compare_json.py GENERATE [ARGS...]: runs `GENERATE --compare --json ARGS` and checks that what it
reports is consistent arithmetic (not a timing assertion): the reported stats are the median runs
of the timed ones listed, the speedup is the ratio of those medians, and tokens/s follows from the
median run's tokens and seconds."""
import json
import math
import subprocess
import sys

output = subprocess.run([*sys.argv[1:2], "--compare", "--json", *sys.argv[2:]], check=True,
                        capture_output=True, text=True).stdout
report = json.loads(output)
compare = report["compare"]


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def median(values):
    return sorted(values)[(len(values) - 1) // 2]


problems = []
if compare["warmup_runs"] < 1:
    problems.append("no warm-up run")
for key, stats in (("seconds", report["stats"]), ("autoregressive_seconds", report["autoregressive"])):
    runs = compare[key]
    if len(runs) != compare["timed_runs"]:
        problems.append(f"{key}: {len(runs)} runs, timed_runs says {compare['timed_runs']}")
    if not close(median(runs), stats["total_seconds"]):
        problems.append(f"{key}: the median {median(runs)} is not the reported run's {stats['total_seconds']}")
    if not close(stats["tokens_per_second"], stats["generated"] / stats["total_seconds"]):
        problems.append(f"{key}: tokens_per_second {stats['tokens_per_second']} is not generated / total_seconds")
expected = median(compare["autoregressive_seconds"]) / median(compare["seconds"])
if not close(report["speedup"], expected):
    problems.append(f"speedup {report['speedup']} is not the ratio of the medians, {expected}")
if not report["identical_to_autoregressive"]:
    problems.append("the outputs differ")
print(json.dumps({"speedup": report["speedup"], "compare": compare}))
if problems:
    print("\n".join(problems))
    sys.exit(1)
print("consistent")
