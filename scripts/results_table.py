"""Regenerate the README's results table from the newest GPU record in benchmarks/results/.

    python scripts/results_table.py [record.json]
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


def main() -> int:
    path = sys.argv[1] if len(sys.argv) > 1 else None
    if path is None:
        records = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.json")))
        records = [p for p in records if json.load(open(p)).get("gpu")]
        if not records:
            print("no GPU record in benchmarks/results/", file=sys.stderr)
            return 1
        path = records[-1]
    rec = json.load(open(path))
    text = table(rec) + (f"\n\nCaveat: {rec['caveat']}." if rec.get("caveat") else "") + f"\n\nSource: `{os.path.relpath(path, ROOT)}`."
    readme = os.path.join(ROOT, "README.md")
    body = open(readme).read()
    body = re.sub(r"<!-- results:start -->.*<!-- results:end -->",
                  "<!-- results:start -->\n" + text.replace("\\", "\\\\") + "\n<!-- results:end -->", body, flags=re.S)
    open(readme, "w").write(body)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
