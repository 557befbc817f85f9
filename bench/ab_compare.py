#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The A/B of `bash bench/device_run.sh ab`: for each moe-bench --json pair new.<tag>.json /
base.<tag>.json in DIR, the step time at each token count on both sides and new / base, then
the geometric mean of the ratios per pair and over all of them (< 1: the new tree is faster).

  python3 bench/ab_compare.py DIR
"""
import glob
import json
import math
import os
import sys


def points(path):
    with open(path) as f:
        run = json.load(f)
    label = "%s %s%s" % (run.get("preset", "?"), run.get("dtype", "?"),
                         " " + run["scales"] if run.get("scales") not in (None, "none") else "")
    return label, {p["m"]: p for p in run["points"]}


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    every = []
    for new in sorted(glob.glob(os.path.join(argv[1], "new.*.json"))):
        base = new.replace(os.sep + "new.", os.sep + "base.")
        if not os.path.exists(base):
            print("== %s: no base run" % os.path.basename(new))
            continue
        label, n = points(new)
        _, b = points(base)
        ratios = []
        print("== %s" % label)
        print("  %6s %10s %10s %8s %8s" % ("M", "new us", "base us", "new/base", "score"))
        for m in sorted(n):
            if m not in b:
                continue
            r = n[m]["time_us"] / b[m]["time_us"]
            ratios.append(r)
            print("  %6d %10.1f %10.1f %8.3f %8.3f" % (m, n[m]["time_us"], b[m]["time_us"], r,
                                                        n[m].get("score", 0.0)))
        if ratios:
            print("  geometric mean %.3f" % math.exp(sum(map(math.log, ratios)) / len(ratios)))
        every += ratios
    if every:
        print("all %d points: geometric mean %.4f, best %.3f, worst %.3f" % (
            len(every), math.exp(sum(map(math.log, every)) / len(every)), min(every), max(every)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
