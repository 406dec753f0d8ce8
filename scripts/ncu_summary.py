"""One line per kernel launch of an ncu CSV (`--csv --page details`, as scripts/ncu_op.py is run):
duration, registers, shared memory, achieved occupancy and the memory and SM throughputs.

    python3 scripts/ncu_summary.py ncu-gdn-fwdbwd.csv
"""

import csv
import sys
from collections import OrderedDict

WANT = ("Duration", "Registers Per Thread", "Dynamic Shared Memory Per Block", "Static Shared Memory Per Block",
        "Achieved Occupancy", "Memory Throughput", "DRAM Throughput", "Compute (SM) Throughput", "Grid Size",
        "Block Size")
launches = OrderedDict()
with open(sys.argv[1], newline="") as f:
    rows = [r for r in csv.reader(f) if r]
header = next(i for i, r in enumerate(rows) if "Metric Name" in r)
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
    total += float(value.replace(",", "")) * {"ns": 1e-3, "nsecond": 1e-3, "ms": 1e3, "msecond": 1e3}.get(unit, 1.0)
    print(f"{entry['name']:<40} " + " | ".join(f"{k.split(' Per')[0]}: {entry.get(k, '-')}" for k in WANT[:1] + WANT[4:8]
                                              + WANT[1:2] + WANT[2:4] + WANT[8:]))
print(f"{len(launches)} launches, {total:.1f} us in all")
