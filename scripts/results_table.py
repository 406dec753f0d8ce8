"""Regenerate the README's results tables from GPU records in benchmarks/results/.

    python scripts/results_table.py [record.json ...]

Without arguments: for each op and mode, the newest GPU record that times it side by side with a
baseline (an fla or torch row); of those records, each (op, shape, mode) row is shown once, from
the newest of them that holds it (a shape only an older record timed is not shown: the README
keeps to current numbers).
"""

import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def table(record: dict) -> str:
    m = record["machine"]
    # Records before the profiled kernel time (bench "kern") have no kernel_ms in any row: their
    # tables keep their old columns rather than gaining an empty one.
    kern = any("kernel_ms" in r for r in record["rows"])
    head = "| op | shape | mode | system | ms | graph ms |" + (" kernel ms |" if kern else "") + " TB/s | % of floor |"
    head += (" % of floor (kernels) |" if kern else "") + " vs FLA (ms) |"
    blank = "|" + " |" * (head.count("|") - 6)  # the cells after the status one
    lines = [
        f"{m.get('gpu')}, torch {m.get('torch')}, triton {m.get('triton')}, commit {m.get('commit')}, {m.get('date')}; "
        f"ceilings measured in the same run: copy {record['ceilings']['copy_tbps']:.2f} TB/s, "
        f"bf16 matmul {record['ceilings']['matmul_tflops']:.0f} TFLOP/s.",
        "",
        "ms: do_bench median (eager launches); graph ms: CUDA-graph replay median (kernel time, no launch cost)."
        + (" kernel ms: torch.profiler's sum of device kernel durations per step, every mode (gaps between kernels"
           " not counted: a lower bound); % of floor (kernels): floor / kernel ms." if kern else ""),
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for r in record["rows"]:
        shape = " ".join(f"{k}={v}" for k, v in (r.get("shape") or {}).items())
        if r.get("status") != "ok":
            lines.append(f"| {r['op']} | {shape} | {r.get('mode') or ''} | {r['system']} | {r.get('status')} {blank}")
            continue
        vs = r.get("speedup_vs", {}).get("fla")
        graph = f"{r['graph_ms']:.3f}" if r.get("graph_ms") else "-"
        if str(r.get("note", "")).startswith("INVALID"):
            lines.append(f"| {r['op']} | {shape} | {r.get('mode')} | {r['system']} | ~~{r['ms']:.3f}~~ invalid: {r['note'][9:80]}... {blank}")
            continue
        kcell = (f" {r['kernel_ms']:.3f} |" if r.get("kernel_ms") else " - |") if kern else ""
        kfrac = (f" {100 * r['frac_floor_kernels']:.0f}% |" if r.get("frac_floor_kernels") else " - |") if kern else ""
        lines.append(f"| {r['op']} | {shape} | {r.get('mode')} | {r['system']} | {r['ms']:.3f} | {graph} |{kcell} {r['tbps']:.2f} | "
                     f"{100 * r['frac_floor']:.0f}% |{kfrac} {'' if vs is None else f'{vs:.2f}x'} |")
    return "\n".join(lines)


def _key(r: dict) -> tuple:
    return r["op"], json.dumps(r.get("shape") or {}, sort_keys=True), r.get("mode")


def default_records() -> dict[str, set]:
    """{path: the (op, shape, mode) keys it shows}, oldest record first. The records: for each op
    and mode, the newest GPU record that times it beside a baseline (an fla or torch row), one with
    an FLA row before any without (a run that did not carry FLA does not hide the side-by-side);
    each then shows only the (op, shape, mode) keys that no newer one of them times."""
    newest: dict[tuple, tuple[bool, str, str]] = {}  # (op, mode) -> (beside FLA, date, path)
    keys_of: dict[str, set] = {}
    for p in glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.json")):
        rec = json.load(open(p))
        if not rec.get("gpu"):
            continue
        ok = [r for r in rec["rows"] if r.get("status") == "ok"]
        keys_of[p] = {_key(r) for r in ok if r["system"] in ("fla", "torch")}
        with_fla = {(op, mode) for op, _, mode in (_key(r) for r in ok if r["system"] == "fla")}
        for op, _, mode in keys_of[p]:
            rank = ((op, mode) in with_fla, rec["machine"].get("date", ""), p)
            if (op, mode) not in newest or rank[:2] > newest[(op, mode)][:2]:
                newest[(op, mode)] = rank
    chosen = sorted({p for _, _, p in newest.values()}, key=lambda p: json.load(open(p))["machine"].get("date", ""))
    owned: dict[str, set] = {}
    for i, p in enumerate(chosen):
        later = set().union(*(keys_of[q] for q in chosen[i + 1:]))
        owned[p] = keys_of[p] - later
    return owned


def owned_rows(rec: dict, keys: set, shown_elsewhere: set) -> dict:
    """rec with only the rows of the (op, shape, mode) keys it owns, plus its rows that time
    nothing (a system refusing or not having the op) at an (op, shape) it owns, unless a newer
    chosen record shows that very row."""
    pairs = {(op, shape) for op, shape, _ in keys}
    rows = []
    for r in rec["rows"]:
        key, who = _key(r), (_key(r), r["system"])
        if key in keys or (r.get("status") != "ok" and key[:2] in pairs and who not in shown_elsewhere):
            rows.append(r)
    return dict(rec, rows=rows)



def main() -> int:
    # given records are shown whole; by default each record shows only the rows no newer record times
    chosen = {p: None for p in sys.argv[1:]} or default_records()
    if not chosen:
        print("no GPU record in benchmarks/results/", file=sys.stderr)
        return 1
    parts = []
    shown = set()  # (key, system) of the rows that time nothing, from the newest record down
    records = {p: json.load(open(p)) for p in chosen}
    for path in reversed(list(chosen)):
        keys = chosen[path]
        if keys is not None:
            owned = owned_rows(records[path], keys, shown)
            shown |= {(_key(r), r["system"]) for r in owned["rows"] if r.get("status") != "ok"}
            records[path] = owned
    for path in chosen:
        rec = records[path]
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
