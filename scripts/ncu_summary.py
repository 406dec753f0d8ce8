"""One line per kernel launch of an ncu CSV, in either of ncu's two CSV layouts:

- `--page details` (as scripts/ncu_op.py is run): duration, registers, shared memory, achieved
  occupancy and the memory and SM throughputs;
- `--page raw` (one column per metric): duration, issue slots busy, warps active and the leading
  stall reasons, in cycles per issued instruction
  (`smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio`), the reading that
  docs/perf/kda.md's twenty-eighth-session status is made of.

    python3 scripts/ncu_summary.py ncu-gdn-fwdbwd.csv [--stalls N]   (N leading stall reasons, default 4)
"""

import csv
import sys
from collections import OrderedDict

WANT = ("Duration", "Registers Per Thread", "Dynamic Shared Memory Per Block", "Static Shared Memory Per Block",
        "Achieved Occupancy", "Memory Throughput", "DRAM Throughput", "Compute (SM) Throughput", "Grid Size",
        "Block Size")
_UNIT_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
_STALL = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")


def _number(text: str) -> float:
    return float(text.replace(",", "")) if text.strip() else 0.0


def details(rows: list, header: int) -> None:
    launches = OrderedDict()
    cols = rows[header]
    ID, NAME, METRIC, UNIT, VALUE = (cols.index(c) for c in ("ID", "Kernel Name", "Metric Name", "Metric Unit",
                                                             "Metric Value"))
    for r in rows[header + 1:]:
        if len(r) <= VALUE or r[METRIC] not in WANT:
            continue
        entry = launches.setdefault(r[ID], {"name": r[NAME].split("(")[0][:40]})
        entry[r[METRIC]] = f"{r[VALUE]} {r[UNIT]}".strip()
    total = 0.0
    for entry in launches.values():
        value, _, unit = entry.get("Duration", "0 us").partition(" ")
        total += _number(value) * _UNIT_US.get(unit, 1.0)
        print(f"{entry['name']:<40} " + " | ".join(f"{k.split(' Per')[0]}: {entry.get(k, '-')}"
                                                  for k in WANT[:1] + WANT[4:8] + WANT[1:2] + WANT[2:4] + WANT[8:]))
    print(f"{len(launches)} launches, {total:.1f} us in all")


def raw(rows: list, header: int, top: int) -> None:
    cols = rows[header]
    units = rows[header + 1]  # the raw page's second row holds the units
    at = {c: i for i, c in enumerate(cols)}
    stalls = [c for c in cols if c.startswith(_STALL[0]) and c.endswith(_STALL[1])]
    time_col = at.get("gpu__time_duration.sum")
    total = 0.0
    launches = 0
    for r in rows[header + 2:]:
        if len(r) != len(cols) or not r[at["ID"]].strip().isdigit():
            continue
        launches += 1
        us = _number(r[time_col]) * _UNIT_US.get(units[time_col], 1.0) if time_col is not None else 0.0
        total += us
        issue = r[at["sm__issue_active.avg.pct_of_peak_sustained_elapsed"]] if \
            "sm__issue_active.avg.pct_of_peak_sustained_elapsed" in at else "-"
        warps = r[at["sm__warps_active.avg.pct_of_peak_sustained_active"]] if \
            "sm__warps_active.avg.pct_of_peak_sustained_active" in at else "-"
        ranked = sorted(((_number(r[at[c]]), c[len(_STALL[0]):-len(_STALL[1])]) for c in stalls), reverse=True)
        leading = ", ".join(f"{name} {value:.2f}" for value, name in ranked[:top])
        print(f"{r[at['Kernel Name']].split('(')[0][:40]:<40} {us:9.1f} us | issue {issue}% | warps active "
              f"{warps}% | stalls per issued instruction: {leading}")
    print(f"{launches} launches, {total:.1f} us in all")


def main(argv: list) -> None:
    path = argv[1]
    top = int(argv[argv.index("--stalls") + 1]) if "--stalls" in argv else 4
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    header = next(i for i, r in enumerate(rows) if "Kernel Name" in r and "ID" in r)
    if "Metric Name" in rows[header]:
        details(rows, header)
    else:
        raw(rows, header, top)


if __name__ == "__main__":
    main(sys.argv)
