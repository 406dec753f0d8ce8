"""Regenerate the README's results tables from GPU records in benchmarks/results/.

    python scripts/results_table.py [record.json ...]

Without arguments: for each op, shape and mode, the newest GPU record that times it side by side
with a baseline (an fla or torch row), one table per record holding only the rows it is the newest
for (so a re-measured op is not shown twice).
"""

import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def table(record: dict) -> str:
    m = record["machine"]
    lines = [
        f"{m.get('gpu')}, torch {m.get('torch')}, triton {m.get('triton')}, commit {m.get('commit')}, {m.get('date')}; "
        f"ceilings measured in the same run: copy {record['ceilings']['copy_tbps']:.2f} TB/s, "
        f"bf16 matmul {record['ceilings']['matmul_tflops']:.0f} TFLOP/s.",
        "",
        "ms: do_bench median (eager launches); graph ms: CUDA-graph replay median (kernel time, no launch cost).",
        "",
        "| op | shape | mode | system | ms | graph ms | TB/s | % of floor | vs FLA (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in record["rows"]:
        shape = " ".join(f"{k}={v}" for k, v in (r["shape"] or {}).items())
        if r.get("status") != "ok":
            lines.append(f"| {r['op']} | {shape} | {r.get('mode', '')} | {r['system']} | {r['status']} | | | | |")
            continue
        vs = r.get("speedup_vs", {}).get("fla")
        graph = f"{r['graph_ms']:.3f}" if r.get("graph_ms") else "-"
        if str(r.get("note", "")).startswith("INVALID"):
            lines.append(f"| {r['op']} | {shape} | {r['mode']} | {r['system']} | ~~{r['ms']:.3f}~~ invalid: {r['note'][9:80]}... | | | | |")
            continue
        lines.append(f"| {r['op']} | {shape} | {r['mode']} | {r['system']} | {r['ms']:.3f} | {graph} | {r['tbps']:.2f} | "
                     f"{100 * r['frac_floor']:.0f}% | {'' if vs is None else f'{vs:.2f}x'} |")
    return "\n".join(lines)


def _key(r: dict) -> tuple:
    return r["op"], json.dumps(r.get("shape") or {}, sort_keys=True), r.get("mode")


def default_records() -> dict[str, set]:
    """{path: the (op, shape, mode) keys it shows}, oldest record first. The records: for each op
    and mode, the newest GPU record that times it beside a baseline (an fla or torch row); each
    then shows only the (op, shape, mode) keys that no newer one of them times."""
    newest: dict[tuple, tuple[str, str]] = {}  # (op, mode) -> (date, path)
    keys_of: dict[str, set] = {}
    for p in glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.json")):
        rec = json.load(open(p))
        if not rec.get("gpu"):
            continue
        ok = [r for r in rec["rows"] if r.get("status") == "ok"]
        keys_of[p] = {_key(r) for r in ok if r["system"] in ("fla", "torch")}
        for op, _, mode in keys_of[p]:
            when = rec["machine"].get("date", "")
            if (op, mode) not in newest or when > newest[(op, mode)][0]:
                newest[(op, mode)] = (when, p)
    chosen = sorted({p for _, p in newest.values()}, key=lambda p: json.load(open(p))["machine"].get("date", ""))
    owned: dict[str, set] = {}
    for i, p in enumerate(chosen):
        later = set().union(*(keys_of[q] for q in chosen[i + 1:]))
        owned[p] = keys_of[p] - later
    return owned


def owned_rows(rec: dict, keys: set) -> dict:
    """rec with only the rows of the (op, shape, mode) keys it owns, and the rows without a mode
    (a system that refuses the op at that shape) of the (op, shape) pairs it owns."""
    pairs = {(op, shape) for op, shape, _ in keys}
    return dict(rec, rows=[r for r in rec["rows"] if _key(r) in keys
                           or (r.get("mode") is None and _key(r)[:2] in pairs)
                           or (r.get("status") != "ok" and _key(r)[:2] in pairs)])



def main() -> int:
    # given records are shown whole; by default each record shows only the rows no newer record times
    chosen = {p: None for p in sys.argv[1:]} or default_records()
    if not chosen:
        print("no GPU record in benchmarks/results/", file=sys.stderr)
        return 1
    parts = []
    for path, keys in chosen.items():
        rec = json.load(open(path))
        rec = rec if keys is None else owned_rows(rec, keys)
        parts.append(table(rec) + (f"\n\nCaveat: {rec['caveat']}." if rec.get("caveat") else "")
                     + f"\n\nSource: `{os.path.relpath(path, ROOT)}`.")
    text = "\n\n".join(parts)
    readme = os.path.join(ROOT, "README.md")
    body = open(readme).read()
    body = re.sub(r"<!-- results:start -->.*<!-- results:end -->",
                  "<!-- results:start -->\n" + text.replace("\\", "\\\\") + "\n<!-- results:end -->", body, flags=re.S)
    open(readme, "w").write(body)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
