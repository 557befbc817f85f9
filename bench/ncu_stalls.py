#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Where a kernel's warps wait, per SASS instruction: reads Nsight Compute's source page as CSV
(`ncu -i REP --page source --csv --print-source sass > FILE`, the report collected with
`--section SourceCounters`) and prints the instructions holding the most warp-stall samples,
the samples per opcode, and per loop (the address range of each backward branch, innermost
first), so a profile names the loads, waits or conversions a loop spends its time on.

Usage: python3 bench/ncu_stalls.py FILE.csv [--top N] [--column NAME]
(the column defaults to the first whose name holds "Stall Sampling (All"; every column whose name
holds "Sampl" or starts with "stall" is summed per opcode and loop as well)."""
import argparse
import csv
import re
import sys


def number(cell):
    cell = cell.replace(",", "").strip()
    try:
        return float(cell)
    except ValueError:
        return None


def load(path):
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    # the header is the first row naming both an address and a source column
    for h, row in enumerate(rows):
        low = [c.strip().lower() for c in row]
        if any("address" in c for c in low) and any(c == "source" for c in low):
            break
    else:
        sys.exit("ncu_stalls: no header with Address and Source columns in %s" % path)
    head = [c.strip() for c in rows[h]]
    addr = next(i for i, c in enumerate(head) if "address" in c.lower())
    src = next(i for i, c in enumerate(head) if c.lower() == "source")
    ins = []
    for r in rows[h + 1:]:
        if len(r) <= max(addr, src):
            continue
        a = r[addr].strip()
        try:
            a = int(a, 16) if a.lower().startswith("0x") else int(a)
        except ValueError:
            continue
        vals = {head[i]: number(r[i]) for i in range(len(head)) if i not in (addr, src) and i < len(r)}
        ins.append((a, r[src].strip(), vals))
    return head, ins


def opcode(text):
    t = re.sub(r"^@!?U?P\w+\s+", "", text.strip())  # predicate
    return t.split(" ")[0].rstrip(";") if t else "?"


def loops(ins):
    """(start, end) of every backward branch's range, innermost (shortest) first."""
    out = []
    for a, text, _ in ins:
        op = opcode(text)
        if not op.startswith("BRA"):
            continue
        m = re.search(r"0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a:
            out.append((int(m.group(1), 16), a))
    return sorted(set(out), key=lambda r: r[1] - r[0])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--column")
    a = ap.parse_args()
    head, ins = load(a.csv)
    cols = [c for c in head if "sampl" in c.lower() or c.lower().startswith("stall")]
    if not cols:
        sys.exit("ncu_stalls: no sampling columns (collect with --section SourceCounters)")
    key = a.column or next((c for c in cols if "stall sampling (all" in c.lower()), cols[0])
    total = sum(v.get(key) or 0 for _, _, v in ins)
    if total <= 0:
        sys.exit("ncu_stalls: no samples in column '%s'" % key)
    print("# %s: %d samples over %d instructions" % (key, total, len(ins)))
    print("# top instructions")
    for addr, text, v in sorted(ins, key=lambda r: -(r[2].get(key) or 0))[:a.top]:
        s = v.get(key) or 0
        print("  %6.2f%%  %06x  %s" % (100 * s / total, addr, text[:110]))
    print("# per opcode (%s" % key + "".join("; " + c for c in cols if c != key) + ")")
    per = {}
    for _, text, v in ins:
        o = opcode(text)
        acc = per.setdefault(o, [0.0] * len(cols))
        for i, c in enumerate(cols):
            acc[i] += v.get(c) or 0
    ki = cols.index(key)
    for o, acc in sorted(per.items(), key=lambda kv: -kv[1][ki])[:20]:
        if acc[ki] <= 0:
            break
        print("  %6.2f%%  %-40s %s" % (100 * acc[ki] / total, o,
                                       " ".join("%.0f" % x for x in acc)))
    print("# per loop, the most samples first (a sample counts in every loop that holds it)")
    summary = []
    for lo, hi in loops(ins):
        body = [(t, v) for a2, t, v in ins if lo <= a2 <= hi]
        s = sum(v.get(key) or 0 for _, v in body)
        ops = {}
        for t, v in body:
            ops[opcode(t)] = ops.get(opcode(t), 0) + (v.get(key) or 0)
        top = ", ".join("%s %.0f%%" % (o, 100 * x / max(s, 1))
                        for o, x in sorted(ops.items(), key=lambda kv: -kv[1])[:5])
        summary.append((s, lo, hi, len(body), top))
    for s, lo, hi, n, top in sorted(summary, reverse=True)[:12]:
        print("  %06x-%06x  %5d instructions  %6.2f%%  (%s)" % (lo, hi, n, 100 * s / total, top))


if __name__ == "__main__":
    main()
