"""`tileport loop`: the porting discipline as commands (contract, gated attempt, evidence).

    tileport loop start <op> [--reason TEXT] [--reopen REASON]
        Record the op's contract at the head of docs/perf/<op>.md, between
        `<!-- loop:contract -->` and `<!-- /loop:contract -->`: sha256 of ops/<op>/reference.py and
        tests/test_<op>_*.py, the gate command, the benchmark shapes (ops/<op>/perf.py STANDARD),
        the floor per shape and mode (perf.minimal_cost at bf16 against SPEC's 4.25 TB/s and
        700 TFLOP/s), and the baseline rows of the newest committed benchmarks/results/*.json that
        has the op. A second `start` is refused; `--reopen "why"` re-records it and logs why.

    tileport loop try "<what changes and the predicted effect>" --op <op> [--base REF] [--no-bench]
        Refuse if the contract's files changed (naming them). Run the parity gate (pytest on the
        op's test files, TRITON_INTERPRET=1 on a CPU machine), then `tileport bench --op <op>
        --json` against a base (default HEAD), and append one row to the log table of
        docs/perf/<op>.md. A failing gate is logged as GATE FAILED, nothing is timed and the
        command exits 1.

    tileport loop report <op> [--last N]
        The contract and whether it holds, the last N log rows with before/after timings, the gate
        status, a coverage matrix of the op's tests (from `pytest --collect-only`), and open risks.

Exit codes: 0 done; 1 the gate (or the benchmark's parity check) failed; 2 refused.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

CONTRACT_BEGIN = "<!-- loop:contract -->"
CONTRACT_END = "<!-- /loop:contract -->"
LOG_COLUMNS = ["version", "date", "commit", "card", "change", "prediction", "outcome"]
CEILINGS = {"copy_tbps": 4.25, "matmul_tflops": 700.0}  # SPEC.md's H200 ceilings: the contract's floors
FLOOR_DTYPE, FLOOR_ELEM_BYTES = "bf16", 2
MODES = ("fwd", "bwd", "fwdbwd")
CPU_CARD = "CPU (timings not meaningful)"
BACKEND_NAMES = ("reference", "triton", "gluon")
DTYPE_NAMES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "e4m3", "e5m2")
PYTEST_ARGS = ["-q", "-rfE", "-p", "no:cacheprovider"]


class Refused(Exception):
    """A command that must not proceed; the message says why and what to do."""


# --------------------------------------------------------------------------------------------
# paths, git, machine


def default_root() -> Path:
    here = Path(__file__).resolve().parents[2]
    if (here / "src" / "tileport").is_dir():
        return here
    top = _git(Path.cwd(), "rev-parse", "--show-toplevel")
    return Path(top) if top else Path.cwd()


class Op:
    """Where an op's files live under a repository root."""

    def __init__(self, root: Path, name: str):
        self.root, self.name = Path(root).resolve(), name
        self.op_dir = self.root / "src" / "tileport" / "ops" / name
        self.reference = self.op_dir / "reference.py"
        self.perf = self.op_dir / "perf.py"
        self.doc = self.root / "docs" / "perf" / f"{name}.md"
        if not self.reference.is_file():
            known = sorted(p.parent.name for p in (self.root / "src" / "tileport" / "ops").glob("*/reference.py"))
            raise Refused(f"unknown op {name!r}: no {self.rel(self.reference)}; ops: {', '.join(known) or 'none'}")

    def rel(self, p: Path) -> str:
        return Path(p).resolve().relative_to(self.root).as_posix()

    def test_files(self) -> list[str]:
        tests = self.root / "tests"
        found = set(glob.glob(str(tests / f"test_{self.name}_*.py"))) | set(glob.glob(str(tests / f"test_{self.name}.py")))
        return sorted(self.rel(Path(p)) for p in found)

    def contract_files(self) -> list[str]:
        return [self.rel(self.reference), *self.test_files()]

    def code_dirs(self) -> list[str]:
        """The op's folder and every other op folder its modules import (KDA runs GDN's kernels):
        a change in any of them changes the op."""
        ops = self.root / "src" / "tileport" / "ops"
        names = {self.name}
        for f in self.op_dir.glob("*.py"):
            text = f.read_text(errors="replace")
            names |= set(re.findall(r"(?:from|import)\s+(?:tileport\.ops\.|\.\.)(\w+)", text))
        return sorted(self.rel(ops / n) + "/" for n in names if (ops / n).is_dir())

    def gate_command(self) -> list[str]:
        return [sys.executable, "-m", "pytest", *PYTEST_ARGS, *self.test_files()]

    def env(self, gpu: bool) -> dict:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(self.root / "src") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        if not gpu:
            env["TRITON_INTERPRET"] = "1"
        return env


def _git(cwd: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _device_commit(root: Path) -> str | None:
    """TILEPORT_COMMIT when it names another commit than the tree's git HEAD: the device machine's
    copy of the tree carries a stale .git (seen 2026-11-29: HEAD at the previous session's last
    commit, so every change since looked uncommitted), and scripts/gpu-check passes the real one."""
    named = os.environ.get("TILEPORT_COMMIT")
    sha = _git(root, "rev-parse", "HEAD")
    if named and not (sha and sha.startswith(named)):
        return named
    return None


def commit_id(root: Path) -> str:
    """TILEPORT_COMMIT where the tree's git is stale or missing (`_device_commit`), else short HEAD
    (+uncommitted when src/ or tests/ differ from it), else 'unknown'."""
    named = _device_commit(root)
    if named:
        return named
    sha = _git(root, "rev-parse", "--short", "HEAD")
    if not sha:
        return "unknown"
    dirty = _git(root, "status", "--porcelain", "--untracked-files=no", "--", "src", "tests")
    return sha + ("+uncommitted" if dirty else "")


def _gpu() -> tuple[bool, str]:
    import torch

    if torch.cuda.is_available():
        return True, torch.cuda.get_device_name()
    return False, CPU_CARD


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _run_tee(cmd, cwd: Path, env: dict, shell: bool = False) -> tuple[int, str]:
    """Run, echoing the output as it comes, and return (rc, output)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, shell=shell, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace")
    out = []
    assert proc.stdout is not None
    for line in proc.stdout:
        out.append(line)
        sys.stdout.write(line)
        sys.stdout.flush()
    return proc.wait(), "".join(out)


# --------------------------------------------------------------------------------------------
# the contract


def hash_files(root: Path, rels: list[str]) -> tuple[str, dict[str, str]]:
    per = {}
    for rel in sorted(rels):
        per[rel] = hashlib.sha256((root / rel).read_bytes()).hexdigest()
    combined = hashlib.sha256("".join(f"{rel}\0{h}\n" for rel, h in per.items()).encode()).hexdigest()
    return combined, per


def contract_changes(contract: dict, op: Op) -> list[str]:
    """The contract's files that changed, disappeared or appeared, as 'path (what)'."""
    _, now = hash_files(op.root, op.contract_files())
    then = contract.get("files", {})
    out = []
    for rel in sorted(set(then) | set(now)):
        if rel not in now:
            out.append(f"{rel} (removed)")
        elif rel not in then:
            out.append(f"{rel} (new test file)")
        elif then[rel] != now[rel]:
            out.append(f"{rel} (changed)")
    return out


def load_perf(op: Op):
    spec = importlib.util.spec_from_file_location(f"_tileport_loop_perf_{op.name}", op.perf)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def floors(perf) -> list[dict]:
    out = []
    for shape in perf.STANDARD:
        for mode in MODES:
            nbytes, flops = perf.minimal_cost(shape, FLOOR_ELEM_BYTES, mode)
            t_bytes = nbytes / (CEILINGS["copy_tbps"] * 1e12) * 1e3
            t_flops = flops / (CEILINGS["matmul_tflops"] * 1e12) * 1e3
            out.append({"shape": dict(shape), "mode": mode, "bytes": int(nbytes), "flops": int(flops),
                        "floor_ms": round(max(t_bytes, t_flops), 6), "bound": "bytes" if t_bytes >= t_flops else "flops"})
    return out


def _rounded(d):
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()} if isinstance(d, dict) else d


def newest_baseline(op: Op) -> dict | None:
    """Rows for the op from the newest committed benchmarks/results/*.json (on-disk files if no git)."""
    listed = _git(op.root, "ls-files", "--", "benchmarks/results/*.json")
    records = []
    if listed is not None:
        for rel in listed.splitlines():
            text = _git(op.root, "show", f"HEAD:{rel}")
            if text:
                records.append((rel, text, "committed"))
    else:
        for p in sorted((op.root / "benchmarks" / "results").glob("*.json")):
            records.append((op.rel(p), p.read_text(), "on disk (no git here)"))
    best = None
    for rel, text, how in records:
        try:
            rec = json.loads(text)
        except ValueError:
            continue
        rows = [r for r in rec.get("rows", []) if r.get("op") == op.name]
        if not rows:
            continue
        machine = rec.get("machine", {})
        date = machine.get("date") or ""
        if best is None or (date, rel) > (best["date"], best["source"]):
            best = {"source": rel, "how": how, "date": date, "card": machine.get("gpu") or CPU_CARD,
                    "commit": machine.get("commit"), "ceilings": _rounded(rec.get("ceilings")),
                    "rows": [_rounded({k: r.get(k) for k in ("shape", "dtype", "mode", "system", "status", "ms",
                                                             "graph_ms", "frac_floor")}) for r in rows]}
    return best


def build_contract(op: Op, reason: str | None) -> dict:
    combined, per = hash_files(op.root, op.contract_files())
    try:
        perf = load_perf(op)
        shapes, small, floor_rows, perf_error = list(perf.STANDARD), list(getattr(perf, "SMALL", [])), floors(perf), None
    except Exception as exc:  # a contract without floors is still a contract; report names the gap
        shapes, small, floor_rows, perf_error = [], [], [], f"{type(exc).__name__}: {exc}"
    gate = " ".join(["python", "-m", "pytest", *PYTEST_ARGS, *op.test_files()])
    return {
        "schema": 1,
        "op": op.name,
        "recorded": _now().isoformat(timespec="seconds"),
        "commit": commit_id(op.root),
        "reason": reason,
        "sha256": combined,
        "files": per,
        "gate": gate + "   (TRITON_INTERPRET=1 on a CPU machine)",
        "ceilings": dict(CEILINGS),
        "floor_dtype": FLOOR_DTYPE,
        "shapes": shapes,
        "small_shapes": small,
        "perf_error": perf_error,
        "floors": floor_rows,
        "baseline": newest_baseline(op),
        "reopened": [],
    }


def _dump(value, depth: int = 0) -> str:
    """Valid JSON, readable in a diff: dicts down to depth 1 and lists of dicts down to depth 2 are
    written one entry a line; everything deeper is compact."""
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(value, dict) and value and depth <= 1:
        body = ",\n".join(f"{inner}{json.dumps(k)}: {_dump(v, depth + 1).lstrip()}" for k, v in value.items())
        return "{\n" + body + "\n" + pad + "}"
    if isinstance(value, list) and value and depth <= 2 and all(isinstance(x, dict) for x in value):
        body = ",\n".join(inner + json.dumps(x) for x in value)
        return "[\n" + body + "\n" + pad + "]"
    return json.dumps(value)


def shape_label(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


def shape_token(shape: dict) -> str:
    return ",".join(f"{k}{v}" for k, v in shape.items())


def _fmt_ms(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def render_floors(contract: dict) -> list[str]:
    out = ["| shape | mode | minimal MB | GFLOP | floor ms | bound |", "|---|---|---|---|---|---|"]
    for f in contract.get("floors", []):
        out.append(f"| {shape_label(f['shape'])} | {f['mode']} | {f['bytes'] / 1e6:.0f} | {f['flops'] / 1e9:.2f} | "
                   f"{f['floor_ms']:.3f} | {f['bound']} |")
    return out


def render_baseline(contract: dict) -> list[str]:
    b = contract.get("baseline")
    if not b:
        return []
    out = ["| shape | mode | system | ms | graph ms | % of floor | status |", "|---|---|---|---|---|---|---|"]
    for r in b["rows"]:
        frac = f"{100 * r['frac_floor']:.0f}%" if r.get("frac_floor") else "-"
        out.append(f"| {shape_label(r['shape'] or {})} | {r.get('mode') or '-'} | {r['system']} | {_fmt_ms(r.get('ms'))} | "
                   f"{_fmt_ms(r.get('graph_ms'))} | {frac} | {r.get('status')} |")
    return out


def render_contract(contract: dict) -> str:
    op = contract["op"]
    lines = [
        CONTRACT_BEGIN,
        f"## Contract (`tileport loop start {op}`)",
        "",
        f"Recorded {contract['recorded']} at commit {contract['commit']}"
        + (f": {contract['reason']}" if contract.get("reason") else "") + ". "
        "Kernel work keeps these files unchanged; `tileport loop try` refuses when they change "
        f"(re-record with `tileport loop start {op} --reopen \"why\"`, which is logged here).",
        "",
        f"Files (sha256 {contract['sha256'][:16]}): " + ", ".join(f"`{f}`" for f in contract["files"]) + ".",
        f"Gate: `{contract['gate']}`.",
        "",
    ]
    for r in contract.get("reopened", []):
        changed = f" (changed: {', '.join(r['changed'])})" if r.get("changed") else ""
        lines.append(f"- Re-opened {r['date']} at {r['commit']}: {r['reason']}{changed}")
    if contract.get("reopened"):
        lines.append("")
    if contract.get("perf_error"):
        lines += [f"perf.py could not be loaded ({contract['perf_error']}): no shapes or floors recorded.", ""]
    else:
        lines += [f"Floors, {contract['floor_dtype']}, max(bytes / {CEILINGS['copy_tbps']} TB/s, "
                  f"flops / {CEILINGS['matmul_tflops']:.0f} TFLOP/s):", "", *render_floors(contract), ""]
    b = contract.get("baseline")
    if b:
        lines += [f"Baseline: `{b['source']}` ({b['how']}), {b['card']}, commit {b['commit']}, {b['date']}:", "",
                  *render_baseline(contract), ""]
    else:
        lines += ["Baseline: no committed record in benchmarks/results/ has rows for this op.", ""]
    lines += ["<details><summary>contract data (read by <code>tileport loop</code>)</summary>", "",
              "```json", _dump(contract), "```", "", "</details>", CONTRACT_END]
    return "\n".join(lines)


def read_contract(text: str) -> dict | None:
    i, j = text.find(CONTRACT_BEGIN), text.find(CONTRACT_END)
    if i < 0 or j < i:
        return None
    m = re.search(r"```json\n(.*?)\n```", text[i:j], re.S)
    if not m:
        raise Refused("the contract block has no ```json fence; fix docs/perf by hand or re-open")
    return json.loads(m.group(1))


def write_contract(text: str, contract: dict) -> str:
    block = render_contract(contract)
    i, j = text.find(CONTRACT_BEGIN), text.find(CONTRACT_END)
    if i >= 0 and j > i:
        return text[:i] + block + text[j + len(CONTRACT_END):]
    lines = text.splitlines(keepends=True)
    if lines and lines[0].startswith("# "):  # after the title
        return lines[0] + "\n" + block + "\n\n" + "".join(lines[1:]).lstrip("\n")
    return block + "\n\n" + text


def _doc_text(op: Op) -> str:
    if op.doc.is_file():
        return op.doc.read_text()
    return (f"# {op.name} performance log\n\n## Log\n\n| " + " | ".join(LOG_COLUMNS) + " |\n|"
            + "---|" * len(LOG_COLUMNS) + "\n")


def cmd_start(args) -> int:
    op = Op(args.root, args.op)
    text = _doc_text(op)
    old = read_contract(text)
    if old and args.reopen is None:
        raise Refused(f"docs/perf/{op.name}.md already has a contract (recorded {old['recorded']} at {old['commit']}, "
                      f"sha256 {old['sha256'][:16]}). To re-record it: tileport loop start {op.name} --reopen \"why\"")
    if args.reopen is not None and not args.reopen.strip():
        raise Refused("--reopen needs a reason")
    contract = build_contract(op, args.reason or (old or {}).get("reason"))
    if old:
        contract["first_recorded"] = old.get("first_recorded") or old["recorded"]
        contract["reopened"] = list(old.get("reopened", [])) + [{
            "date": contract["recorded"], "commit": contract["commit"], "reason": args.reopen.strip(),
            "changed": contract_changes(old, op)}]
    op.doc.parent.mkdir(parents=True, exist_ok=True)
    op.doc.write_text(write_contract(text, contract))
    verb = "re-opened" if old else "recorded"
    print(f"contract {verb}: {op.rel(op.doc)}")
    print(f"  files   {', '.join(contract['files'])}  (sha256 {contract['sha256'][:16]})")
    print(f"  gate    {contract['gate']}")
    print(f"  shapes  {'; '.join(shape_label(s) for s in contract['shapes']) or '(none: ' + str(contract['perf_error']) + ')'}")
    b = contract["baseline"]
    print(f"  baseline {b['source'] + ' (' + b['card'] + ', ' + str(b['commit']) + ')' if b else 'none'}")
    if old:
        print(f"  reason  {args.reopen.strip()}")
    return 0


# --------------------------------------------------------------------------------------------
# the log table


def _split_row(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [c.strip().replace("\\|", "|") for c in cells]


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _log_header_index(lines: list[str]) -> int | None:
    for i, line in enumerate(lines):
        if line.startswith("|") and [c.lower() for c in _split_row(line)] == LOG_COLUMNS:
            return i
    return None


def read_log(text: str) -> list[dict]:
    lines = text.splitlines()
    h = _log_header_index(lines)
    if h is None:
        return []
    rows = []
    for line in lines[h + 2:]:
        if not line.startswith("|"):
            break
        cells = _split_row(line)
        cells += [""] * (len(LOG_COLUMNS) - len(cells))
        rows.append(dict(zip(LOG_COLUMNS, cells)))
    return rows


def append_log_row(text: str, row: dict) -> str:
    line = "| " + " | ".join(_cell(row.get(c, "")) for c in LOG_COLUMNS) + " |"
    lines = text.splitlines()
    h = _log_header_index(lines)
    if h is None:
        lines += ["", "## Log", "", "| " + " | ".join(LOG_COLUMNS) + " |", "|" + "---|" * len(LOG_COLUMNS), line]
    else:
        i = h + 2
        while i < len(lines) and lines[i].startswith("|"):
            i += 1
        lines.insert(i, line)
    return "\n".join(lines) + "\n"


def replace_last_log_row(text: str, row: dict) -> str:
    """text with the log's last row replaced by `row`."""
    lines = text.splitlines()
    h = _log_header_index(lines)
    if h is None:
        raise ValueError("no log table")
    i = h + 2
    while i < len(lines) and lines[i].startswith("|"):
        i += 1
    if i == h + 2:
        raise ValueError("the log has no row")
    lines[i - 1] = "| " + " | ".join(_cell(row.get(c, "")) for c in LOG_COLUMNS) + " |"
    return "\n".join(lines) + "\n"


_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b")


def pytest_summary(output: str) -> str | None:
    for line in reversed(output.splitlines()):
        if re.search(r"\bin [\d.]+s\b", line) and _COUNT.search(line):
            return ", ".join(f"{n} {w}" for n, w in _COUNT.findall(line))
    return None


def pytest_failures(output: str, n: int = 3) -> list[str]:
    out = []
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            out.append(line.split(" ", 1)[1].split(" - ")[0].strip())
    return out[:n]


# One timing in the outcome cell: "<system> <mode> <shape> <ms> ms[ (graph <ms>)][ (base <ms> ms, x<base/after>)]".
ENTRY = re.compile(r"(?P<system>[\w.-]+) (?P<mode>fwdbwd|fwd|bwd) (?P<shape>[A-Za-z]+\d+(?:,[A-Za-z]+\d+)*) "
                   r"(?P<ms>[\d.]+) ms(?: \(graph (?P<graph>[\d.]+)\))?(?: \(base (?P<base>[\d.]+) ms, x(?P<x>[\d.]+)\))?")


def format_bench(record: dict, op: str) -> tuple[str, bool]:
    """The outcome text for a bench record, and whether one of our backends failed its parity check."""
    rows = [r for r in record.get("rows", []) if r.get("op") == op]
    base = record.get("base") or {}
    comp = {(json.dumps(c["shape"], sort_keys=True), c["mode"], c["system"]): c for c in base.get("comparison", [])}
    entries, failed = [], False
    for r in rows:
        tok = shape_token(r["shape"])
        if r.get("status") == "ok":
            e = f"{r['system']} {r['mode']} {tok} {r['ms']:.3f} ms"
            if r.get("graph_ms"):
                e += f" (graph {r['graph_ms']:.3f})"
            c = comp.get((json.dumps(r["shape"], sort_keys=True), r["mode"], r["system"]))
            if c:
                e += f" (base {c['before_ms']:.3f} ms, x{c['speedup']:.2f})"
            entries.append(e)
        else:
            status = str(r.get("status"))
            if status.startswith("FAIL") and r["system"] in BACKEND_NAMES:
                failed = True
                status = "BENCH PARITY " + status
            entries.append(f"{r['system']} {r.get('mode', '-')} {tok}: {status[:80]}")
    args = record.get("args", {})
    if base.get("error"):
        head = f"base {base.get('ref')} could not run ({str(base['error'])[:80]})"
    elif base:
        head = f"base/after vs {base.get('ref')} ({base.get('commit')})"
    else:
        head = "no base"
    return f"bench {args.get('dtype', '?')}, {head}: " + "; ".join(entries), failed


def _changed_since(op: Op, gated: str, contract: dict | None) -> str | None:
    """What changed under src/ and tests/ between the last gated commit and HEAD, and whether any
    of it is this op's code or contract: a reviewer's first question about an ungated HEAD."""
    ref = gated.split()[0].split("+")[0]
    if _device_commit(op.root):
        return None  # this copy's git is stale: its HEAD is not the tree's
    names = _git(op.root, "diff", "--name-only", ref, "HEAD", "--", "src", "tests")
    if names is None:
        return None
    files = [f for f in names.splitlines() if f]
    if not files:
        return f"since {ref}: nothing changed under src/ or tests/"
    dirs = op.code_dirs()
    mine = [f for f in files if any(f.startswith(d) for d in dirs) or f in (contract or {}).get("files", {})]
    more = f" and {len(files) - 8} more" if len(files) > 8 else ""
    verdict = (f"{len(mine)} of them this op's code or contract: " + ", ".join(mine[:8])) if mine else \
        "none of them this op's code or contract"
    return f"since {ref}, changed under src/ and tests/: " + ", ".join(files[:8]) + more + f"; {verdict}"


def _changed_sources(op: Op, base: str) -> str:
    if _device_commit(op.root):
        return f"(at {_device_commit(op.root)}; this copy's git is stale: change not recorded)"
    names = _git(op.root, "diff", "--name-only", base, "--", "src")
    untracked = _git(op.root, "ls-files", "--others", "--exclude-standard", "--", "src")
    if names is None:
        return "(no git: change not recorded)"
    files = sorted(set(names.splitlines()) | set((untracked or "").splitlines()))
    files = [f[len("src/tileport/"):] if f.startswith("src/tileport/") else f for f in files if f]
    if not files:
        return f"no source change vs {base}"
    more = f" and {len(files) - 6} more" if len(files) > 6 else ""
    return f"vs {base}: " + ", ".join(files[:6]) + more


def _run_bench(op: Op, args, gpu: bool) -> tuple[int, dict | None, str]:
    """`tileport bench --op <op> --json` in a subprocess on the op's tree; (rc, record or None, output)."""
    with tempfile.TemporaryDirectory(prefix="tileport-loop-") as tmp:
        out = os.path.join(tmp, "bench.json")
        cmd = [sys.executable, "-m", "tileport", "bench", "--op", op.name, "--json", out]
        if args.base and args.base.lower() != "none":
            cmd += ["--base", args.base]
        shapes = args.shapes or ("anchor" if gpu else None)  # on the CPU bench picks its tiny shapes
        if shapes:
            cmd += ["--shapes", shapes]
        for flag in ("backends", "modes", "dtype"):
            if getattr(args, flag):
                cmd += [f"--{flag}", getattr(args, flag)]
        print(f"== bench: {' '.join(shlex.quote(c) for c in cmd[1:])}", flush=True)
        rc, output = _run_tee(cmd, op.root, op.env(gpu))
        record = None
        if os.path.exists(out):
            with open(out) as f:
                record = json.load(f)
    return rc, record, output


def cmd_try(args) -> int:
    op = Op(args.root, args.op)
    text = _doc_text(op)
    contract = read_contract(text)
    if contract is None:
        raise Refused(f"no contract in docs/perf/{op.name}.md: run `tileport loop start {op.name}` first")
    changed = contract_changes(contract, op)
    if changed:
        raise Refused("the contract's files changed since it was recorded "
                      f"({contract['recorded']}, {contract['commit']}): " + ", ".join(changed)
                      + ". The reference and the parity tests are frozen during kernel work; if the change is "
                      f"intended, re-open the contract: tileport loop start {op.name} --reopen \"why\"")
    gpu, card = _gpu()
    env = op.env(gpu)
    if getattr(args, "bench_only", False):
        return _bench_after_gate(op, text, args, gpu)
    if args.gate_cmd:
        gate_cmd, shell, gate_label = args.gate_cmd, True, f"gate `{args.gate_cmd}`"
    else:
        if not op.test_files():
            raise Refused(f"no parity tests: tests/test_{op.name}_*.py matches nothing")
        gate_cmd, shell, gate_label = op.gate_command(), False, "gate"
    shown = gate_cmd if shell else " ".join(shlex.quote(c) for c in gate_cmd[1:])
    print(f"== {gate_label}{'' if gpu else ' (TRITON_INTERPRET=1)'}: {shown}", flush=True)
    rc, output = _run_tee(gate_cmd, op.root, env, shell=shell)
    summary = pytest_summary(output) or f"exit {rc}"
    row = {"version": f"loop {1 + sum(r['version'].startswith('loop ') for r in read_log(text))}",
           "date": _now().date().isoformat(), "commit": commit_id(op.root), "card": card,
           "change": args.change or _changed_sources(op, args.base if args.base and args.base.lower() != "none" else "HEAD"),
           "prediction": args.text}
    status = 0
    if rc != 0:
        fails = pytest_failures(output)
        row["outcome"] = (f"GATE FAILED ({gate_label}: {summary})" + (f"; failing: {', '.join(fails)}" if fails else "")
                          + "; nothing timed, no speedup claimed")
        status = 1
    elif args.no_bench:
        row["outcome"] = f"gate passed ({summary}); {_GATE_ONLY} [tree {tree_digest(op.root)}]"
    else:
        status = _bench_into(row, f"gate passed ({summary})", op, args, gpu)
    op.doc.parent.mkdir(parents=True, exist_ok=True)
    op.doc.write_text(append_log_row(op.doc.read_text() if op.doc.is_file() else text, row))
    print(f"\nlogged {row['version']} in {op.rel(op.doc)}: {row['outcome']}")
    return status


def _bench_into(row: dict, gate: str, op: "Op", args, gpu: bool, label: str = "") -> int:
    """Run the op's bench and write the row's outcome (the gate's words, then the bench's) and
    card; the try's exit status: 1 when the bench did not run or a system failed, else 0."""
    brc, record, boutput = _run_bench(op, args, gpu)
    if record is None:
        tail = " ".join(boutput.strip().splitlines()[-2:])[-160:]
        row["outcome"] = f"{gate}; bench did not run (rc {brc}): {tail}"
        return 1
    row["card"] = record.get("machine", {}).get("gpu") or CPU_CARD
    bench_text, failed = format_bench(record, op.name)
    row["outcome"] = f"{gate}; {label}{bench_text}"
    return 1 if (failed or brc not in (0, 1)) else 0


_GATE_ONLY = "no bench (--no-bench)"
_TREE = re.compile(r"\[tree ([0-9a-f]{12})\]")


def tree_digest(root: Path) -> str:
    """sha256 (12 hex digits) of the Python files under src/ and tests/, by path and content: what
    scripts/_tree_digest.sh computes, so the device's copy of a tree (no git there) and this
    machine's agree on whether two runs saw the same code, whatever commits only docs/ made."""
    import hashlib

    files = sorted(str(p.relative_to(root)) for d in ("src", "tests") for p in (root / d).rglob("*.py")
                   if p.is_file() and "__pycache__" not in p.parts)
    lines = "".join(f"{f}  {hashlib.sha256((root / f).read_bytes()).hexdigest()}\n" for f in files)
    return hashlib.sha256(lines.encode()).hexdigest()[:12]


def _bench_after_gate(op: "Op", text: str, args, gpu: bool) -> int:
    """`try --bench-only`: the bench for the log's last row when that row is a gate that passed
    with --no-bench on this very code (the digest of src/ and tests/ it recorded: commits of docs
    alone, such as the one that brings the gate's row back from the device, do not count); the
    gate and the bench in two device calls, each within its time limit. The row's outcome gets
    the bench; nothing else is re-run."""
    if args.no_bench:
        raise Refused("--bench-only and --no-bench together time nothing and gate nothing")
    rows = read_log(text)
    last = rows[-1] if rows else None
    here = commit_id(op.root)
    if (last is None or not last["version"].startswith("loop ") or not last["outcome"].startswith("gate passed")
            or _GATE_ONLY not in last["outcome"]):
        raise Refused("--bench-only needs the log's last row to be a gate that passed with --no-bench "
                      "(run `tileport loop try ... --no-bench` first)")
    gated = _TREE.search(last["outcome"])
    if gated is None or gated.group(1) != tree_digest(op.root):
        raise Refused(f"--bench-only: the gate passed on another tree than this one ({last['commit']}, now {here}; "
                      "src/ or tests/ changed since): run the gate again on this tree")
    print(f"== bench for {last['version']}, whose gate passed at {here}", flush=True)
    row = dict(last)
    gate = _TREE.sub("", last["outcome"].replace("; " + _GATE_ONLY, "")).rstrip()
    status = _bench_into(row, gate, op, args, gpu, "bench in a second call: ")
    op.doc.write_text(replace_last_log_row(op.doc.read_text(), row))
    print(f"\nlogged {row['version']} in {op.rel(op.doc)}: {row['outcome']}")
    return status


# --------------------------------------------------------------------------------------------
# the report


def collect_tests(op: Op, gpu: bool) -> tuple[list[str], str | None]:
    files = op.test_files()
    if not files:
        return [], "no test files"
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
    proc = subprocess.run(cmd, cwd=op.root, env=op.env(gpu), capture_output=True, text=True)
    ids = [line.strip() for line in proc.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if proc.returncode != 0:
        return ids, f"collection failed (rc {proc.returncode}): {' '.join(proc.stdout.strip().splitlines()[-2:])[:200]}"
    return ids, None


def _direction(path: str, func: str) -> str:
    f = func.lower()
    if "error" in path or "raises" in f or "bad_input" in f:
        return "input validation"
    if "forward_backward" in f or "fwdbwd" in f or ("forward" in f and "backward" in f):
        return "fwd+bwd"
    if "backward" in f or "bwd" in f or "grad" in f:
        return "bwd"
    if "forward" in f or "fwd" in f:
        return "fwd"
    return "(not in the name)"


def classify(nodeid: str) -> dict:
    """Axes a test id shows: backend, dtype, shape, features, direction, test function."""
    path, _, rest = nodeid.partition("::")
    func, _, params = rest.partition("[")
    params = params[:-1] if params.endswith("]") else params
    out = {"func": func, "backend": None, "dtypes": [], "shape": None, "features": [],
           "direction": _direction(path, func)}
    if not params:
        return out
    if " " in params:  # a labelled case ("mismatched D"): not split into axes
        out["features"] = []
        return out
    shape_parts = []
    for tok in params.split("-"):
        if tok in BACKEND_NAMES:
            out["backend"] = tok
        elif tok in DTYPE_NAMES:
            out["dtypes"].append(tok)
        elif re.fullmatch(r"[A-Z]+\d+|\d+(x\d+)*", tok):
            shape_parts.append(tok)
        elif tok:
            out["features"].append(tok)
    out["shape"] = "-".join(shape_parts) or None
    return out


def coverage_matrix(ids: list[str]) -> tuple[list[str], list[tuple[str, dict]], list[str]]:
    """(columns, [(row label, {column: count})], gaps). Columns are the backends seen, then '(any)'."""
    cls = [classify(i) for i in ids]
    backends = [b for b in BACKEND_NAMES if any(c["backend"] == b for c in cls)]
    cols = backends + ["(no backend)"]
    rows: dict[str, dict] = {}

    def add(label, c):
        rows.setdefault(label, {k: 0 for k in cols})[c["backend"] or "(no backend)"] += 1

    for c in cls:
        add(f"test: {c['func']}", c)
        add(f"direction: {c['direction']}", c)
        for d in c["dtypes"]:
            add(f"dtype: {d}", c)
        if c["shape"]:
            add(f"shape: {c['shape']}", c)
        for f in c["features"]:
            add(f"feature: {f}", c)
    order = {"test": 0, "direction": 1, "dtype": 2, "shape": 3, "feature": 4}
    labels = sorted(rows, key=lambda k: (order[k.split(":")[0]], list(rows).index(k)))
    gaps = []
    for label in labels:
        if label.startswith("shape:") or label.endswith("(not in the name)"):
            continue
        counts = rows[label]
        have = [b for b in backends if counts[b]]
        lack = [b for b in backends if not counts[b] and b != "reference"]  # the reference is the contract itself
        if have and lack:
            gaps.append(f"{label}: no {'/'.join(lack)} case (has {'/'.join(have)})")
    if not any(r["(no backend)"] for r in rows.values()):
        cols.remove("(no backend)")
    return cols, [(label, rows[label]) for label in labels], gaps


def _gate_of(row: dict) -> str:
    o = row.get("outcome", "")
    if o.startswith("GATE FAILED"):
        return "FAILED"
    m = re.match(r"gate passed \(([^)]*)\)", o)
    if m:
        return f"passed ({m.group(1)})"
    return "-"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def cmd_report(args) -> int:
    op = Op(args.root, args.op)
    text = op.doc.read_text() if op.doc.is_file() else ""
    contract = read_contract(text) if text else None
    gpu, card = _gpu()
    risks: list[str] = []
    out: list[str] = [f"# tileport loop report: {op.name}", "", f"root {op.root}, HEAD {commit_id(op.root)}, this machine: {card}", ""]

    # -- contract
    out.append("## Contract")
    floor_of: dict = {}
    baseline_of: dict = {}
    if contract is None:
        out.append(f"none: run `tileport loop start {op.name}`")
        risks.append("no contract: the reference and the parity tests are not frozen for this op")
    else:
        changed = contract_changes(contract, op)
        holds = "HOLDS" if not changed else "BROKEN: " + ", ".join(changed)
        out += [f"recorded {contract['recorded']} at {contract['commit']}"
                + (f" (first recorded {contract['first_recorded']})" if contract.get("first_recorded") else "")
                + (f"; reason: {contract['reason']}" if contract.get("reason") else ""),
                f"sha256 {contract['sha256']}: {holds}"]
        for f in contract["files"]:
            out.append(f"  {f}")
        out.append(f"gate: {contract['gate']}")
        if contract.get("floors"):
            out += ["", f"floors ({contract['floor_dtype']}, {CEILINGS['copy_tbps']} TB/s, "
                        f"{CEILINGS['matmul_tflops']:.0f} TFLOP/s):", "", *render_floors(contract)]
        for f in contract.get("floors", []):
            floor_of[(shape_token(f["shape"]), f["mode"])] = f["floor_ms"]
        b = contract.get("baseline")
        if b:
            out += ["", f"baseline: {b['source']}, {b['card']}, commit {b['commit']}, {b['date']}:", "", *render_baseline(contract)]
            for r in b["rows"]:
                if r.get("ms") is not None:
                    baseline_of[(shape_token(r["shape"]), r["mode"], r["system"])] = r
        else:
            out.append("baseline: none")
            risks.append("no baseline: no committed benchmarks/results record has rows for this op")
        for r in contract.get("reopened", []):
            out.append(f"re-opened {r['date']} at {r['commit']}: {r['reason']}"
                       + (f" (changed: {', '.join(r['changed'])})" if r.get("changed") else ""))
        if changed:
            risks.append("contract broken: " + ", ".join(changed) + " (try refuses until re-opened)")
        if contract.get("reopened"):
            risks.append(f"contract re-opened {len(contract['reopened'])}x: "
                         + "; ".join(f"{r['date'][:10]} {r['reason']}" for r in contract["reopened"]))
    out.append("")

    # -- log
    log = read_log(text)
    last = log[-args.last:] if args.last > 0 else []
    out.append(f"## Log (last {len(last)} of {len(log)} rows)")
    rows, timings = [], []
    for r in last:
        loop_row = r["version"].startswith("loop ")
        entries = list(ENTRY.finditer(r["outcome"])) if loop_row else []
        if not loop_row:
            summary = _short(r["outcome"], 90)
        elif r["outcome"].startswith("GATE FAILED"):
            summary = _short(r["outcome"], 90)
        else:
            summary = f"{len(entries)} timing{'s' if len(entries) > 1 else ''}" if entries else _short(r["outcome"].split("; ", 1)[-1], 60)
        rows.append([r["version"], r["date"], r["commit"], _short(r["card"], 30), _gate_of(r) if loop_row else "-",
                     _short(r["prediction"], 70), summary])
        gpu_row = "CPU" not in r["card"]
        dtype = re.search(r"\bbench (\w+),", r["outcome"])
        floors_apply = gpu_row and dtype is not None and dtype.group(1) == (contract or {}).get("floor_dtype")
        for m in entries:
            key = (m["shape"], m["mode"])
            floor = floor_of.get(key)
            bl = baseline_of.get((m["shape"], m["mode"], m["system"]))
            ms = float(m["ms"])
            timings.append([r["version"], m["system"], m["mode"], m["shape"], m["base"] or "-", f"{ms:.3f}",
                            f"x{m['x']}" if m["x"] else "-",
                            _fmt_ms(bl["ms"]) if (bl and gpu_row) else "-",
                            f"{100 * floor / ms:.0f}%" if (floor and floors_apply) else "-"])
    if rows:
        out += _table(["version", "date", "commit", "card", "gate", "prediction", "outcome"], rows)
    else:
        out.append("no rows")
    if timings:
        out += ["", "before/after (median ms; base/after > 1 is faster; baseline = the contract's record; "
                    "% of floor only for GPU rows at the contract's shapes):", ""]
        out += _table(["version", "system", "mode", "shape", "base ms", "ms", "base/after", "baseline ms", "% of floor"],
                      timings)
    out.append("")

    # -- gate
    out.append("## Gate")
    loop_rows = [r for r in log if r["version"].startswith("loop ")]
    if not loop_rows:
        out.append("the gate has not run through `tileport loop try` for this op")
        risks.append("no gated attempt logged (`tileport loop try`)")
    else:
        lr = loop_rows[-1]
        out.append(f"last: {lr['version']} {lr['date']} at {lr['commit']} on {lr['card']}: {_gate_of(lr)}")
        n_failed = sum(r["outcome"].startswith("GATE FAILED") for r in loop_rows)
        out.append(f"gated attempts: {len(loop_rows)}, failed: {n_failed}")
        head = commit_id(op.root)
        if lr["commit"] != head:
            out.append(f"HEAD is {head}: the gate has not run on it through the loop")
            since = _changed_since(op, lr["commit"], contract)
            if since:
                out.append(since)
            risks.append(f"HEAD {head} not gated (last gated row: {lr['commit']})")
        failed = [r["version"] for r in loop_rows if r["outcome"].startswith("GATE FAILED")]
        if failed:
            risks.append(f"gate failures: {', '.join(failed)}" + (" (including the latest)" if failed[-1] == lr["version"] else ""))
        parity = [r["version"] for r in loop_rows if "BENCH PARITY FAIL" in r["outcome"]]
        if parity:
            risks.append(f"bench parity failures: {', '.join(parity)}")
        no_gpu = [r["version"] for r in loop_rows if "CPU" in r["card"] or not ENTRY.search(r["outcome"])]
        if no_gpu:
            risks.append(f"rows without GPU timings: {', '.join(no_gpu)}")
        no_base = [r["version"] for r in loop_rows if "could not run" in r["outcome"]]
        if no_base:
            risks.append(f"rows whose base could not run: {', '.join(no_base)}")
    out.append("")

    # -- coverage
    out.append("## Coverage (pytest --collect-only on " + ", ".join(op.test_files()) + ")")
    if args.no_collect:
        out.append("skipped (--no-collect)")
    else:
        ids, err = collect_tests(op, gpu)
        if err:
            out.append(err)
            risks.append(f"test collection: {err}")
        if ids:
            cols, matrix, gaps = coverage_matrix(ids)
            out.append(f"{len(ids)} test ids collected on {'this GPU' if gpu else 'the CPU (TRITON_INTERPRET=1)'}; "
                       "collected is not run: skips at run time (backend unavailable or refusing a shape) are not "
                       "visible here" + ("" if gpu else ", and GPU-only cases are missing") + ".")
            out.append("")
            out += _table(["axis", *cols], [[label, *(str(c[k]) if c[k] else "-" for k in cols)] for label, c in matrix])
            if gaps:
                out += ["", "gaps (an axis value some backends have and a kernel backend lacks):", *(f"- {g}" for g in gaps)]
                risks += [f"coverage gap: {g}" for g in gaps]
    out.append("")

    out.append("## Open risks")
    out += [f"- {r}" for r in risks] or ["none found"]
    print("\n".join(out))
    return 0


# --------------------------------------------------------------------------------------------
# CLI


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", type=Path, default=None, help="repository root (default: the tree this tileport is in)")
    sub = p.add_subparsers(dest="loop_cmd", required=True)

    s = sub.add_parser("start", parents=[common], help="record the op's contract at the head of docs/perf/<op>.md")
    s.add_argument("op")
    s.add_argument("--reason", default=None, help="why this porting loop starts (kept in the contract)")
    s.add_argument("--reopen", default=None, metavar="REASON",
                   help="re-record an existing contract (reference or tests changed on purpose); the reason is logged")

    t = sub.add_parser("try", parents=[common], help="check the contract, run the gate and the bench, log one row")
    t.add_argument("text", help="what changes and the predicted effect (the log's prediction)")
    t.add_argument("--op", required=True)
    t.add_argument("--base", default="HEAD", help="git ref to time against (default HEAD; 'none' for no base)")
    t.add_argument("--no-bench", action="store_true", help="gate only (quick, on the CPU): no timing claimed")
    t.add_argument("--bench-only", action="store_true",
                   help="the bench for the last row, a gate that passed with --no-bench at this commit "
                        "(gate and bench in two device calls)")
    t.add_argument("--gate-cmd", default=None, help="shell command replacing the gate (tests)")
    t.add_argument("--change", default=None, help="the log's change cell (default: source files changed vs the base)")
    t.add_argument("--shapes", default=None, help="bench --shapes (default: anchor on a GPU, bench's tiny shapes on the CPU)")
    t.add_argument("--backends", default=None, help="bench --backends")
    t.add_argument("--modes", default=None, help="bench --modes")
    t.add_argument("--dtype", default=None, help="bench --dtype")

    r = sub.add_parser("report", parents=[common], help="the contract, log rows, gate, coverage and open risks")
    r.add_argument("op")
    r.add_argument("--last", type=int, default=10, help="log rows shown (default 10)")
    r.add_argument("--no-collect", action="store_true", help="skip the pytest collection (coverage matrix)")
    return p


def main(args=None) -> int:
    if args is None or isinstance(args, (list, tuple)):
        args = add_arguments(argparse.ArgumentParser(prog="tileport loop")).parse_args(args)
    args.root = Path(args.root) if args.root else default_root()
    try:
        return {"start": cmd_start, "try": cmd_try, "report": cmd_report}[args.loop_cmd](args)
    except Refused as exc:
        print(f"tileport loop {args.loop_cmd}: refused: {exc}", file=sys.stderr)
        return 2
