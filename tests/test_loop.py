"""`tileport loop` on a throwaway git repository holding a fake op (never the real repo's files)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tileport import cli, loop

REFERENCE = "def fake_reference(x):\n    return x * 2\n"
PERF = '''
STANDARD = [dict(N=1 << 20, D=256)]
SMALL = [dict(N=8, D=4)]


def minimal_cost(shape, elem_bytes, mode):
    n = shape["N"] * shape["D"]
    return {"fwd": 2, "bwd": 3, "fwdbwd": 5}[mode] * n * elem_bytes, 1000 * n
'''
PARITY = '''
import pytest


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", ["N8-D4-fp32", "N3-D5-bf16-varlen"])
def test_forward_backward(case, backend):
    pass


@pytest.mark.parametrize("backend", ["reference"])
def test_state_extremes(backend):
    pass
'''
DOC = """# Fake performance log

Card: none.

## Log

| version | date | commit | card | change | prediction | outcome |
|---|---|---|---|---|---|---|
| v0 | 2026-01-01 | 0000000 | H200 | by hand | hand prediction | hand outcome |

## Notes after the log
"""


def _record(date, op, ms, commit):
    return {"schema": 1, "machine": {"date": date, "gpu": "NVIDIA H200", "commit": commit}, "ceilings": {},
            "rows": [{"op": op, "shape": {"N": 1 << 20, "D": 256}, "dtype": "bf16", "mode": "fwd", "system": "triton",
                      "status": "ok", "ms": ms, "graph_ms": None, "frac_floor": 0.5}]}


def _git(root, *args):
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    return make_repo(tmp_path)


def make_repo(tmp_path):
    root = tmp_path / "repo"
    op_dir = root / "src" / "tileport" / "ops" / "fake"
    op_dir.mkdir(parents=True)
    (op_dir / "reference.py").write_text(REFERENCE)
    (op_dir / "perf.py").write_text(PERF)
    (root / "tests").mkdir()
    (root / "tests" / "test_fake_parity.py").write_text(PARITY)
    (root / "tests" / "test_other_parity.py").write_text("def test_x():\n    pass\n")  # another op's: not hashed
    res = root / "benchmarks" / "results"
    res.mkdir(parents=True)
    (res / "old.json").write_text(json.dumps(_record("2026-01-01T00:00:00+00:00", "fake", 9.0, "1111111")))
    (res / "new.json").write_text(json.dumps(_record("2026-02-01T00:00:00+00:00", "fake", 1.0, "2222222")))
    (res / "other-op.json").write_text(json.dumps(_record("2026-03-01T00:00:00+00:00", "other", 5.0, "3333333")))
    (root / "docs" / "perf").mkdir(parents=True)
    (root / "docs" / "perf" / "fake.md").write_text(DOC)
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "fake op")
    # newer, but not committed: the baseline must not come from it
    (res / "uncommitted.json").write_text(json.dumps(_record("2026-04-01T00:00:00+00:00", "fake", 7.0, "4444444")))
    return root


def run(root, *argv):
    return cli.main(["loop", *argv, "--root", str(root)])


def doc(root):
    return (root / "docs" / "perf" / "fake.md").read_text()


def test_start_writes_contract(repo, capsys):
    assert run(repo, "start", "fake", "--reason", "port the fake op") == 0
    text = doc(repo)
    assert text.startswith("# Fake performance log\n")  # the contract goes under the title
    assert text.index(loop.CONTRACT_BEGIN) < text.index("Card: none.") < text.index("| v0 |")
    c = loop.read_contract(text)
    files = ["src/tileport/ops/fake/reference.py", "tests/test_fake_parity.py"]
    assert list(c["files"]) == files
    assert c["sha256"] == loop.hash_files(repo, files)[0]
    assert "tests/test_fake_parity.py" in c["gate"] and "test_other" not in c["gate"]
    assert c["shapes"] == [{"N": 1 << 20, "D": 256}] and c["reason"] == "port the fake op"
    floors = {f["mode"]: f for f in c["floors"]}
    n = (1 << 20) * 256
    assert floors["fwd"]["bound"] == "flops" and floors["fwdbwd"]["bound"] == "bytes"
    assert floors["fwd"]["floor_ms"] == pytest.approx(1000 * n / 700e12 * 1e3, rel=1e-5)
    assert floors["fwdbwd"]["floor_ms"] == pytest.approx(5 * n * 2 / 4.25e12 * 1e3, rel=1e-5)
    b = c["baseline"]
    assert b["source"] == "benchmarks/results/new.json" and b["commit"] == "2222222"  # newest committed, with the op
    assert b["rows"][0]["ms"] == 1.0
    assert "| N=1048576 D=256 | fwd |" in text  # the rendered floor table


def test_start_twice_refused_reopen_logs_reason(repo, capsys):
    assert run(repo, "start", "fake") == 0
    before = doc(repo)
    assert run(repo, "start", "fake") == 2
    assert "already has a contract" in capsys.readouterr().err
    assert doc(repo) == before
    (repo / "src" / "tileport" / "ops" / "fake" / "reference.py").write_text(REFERENCE + "# fixed a typo\n")
    assert run(repo, "start", "fake", "--reopen", "reference docstring fixed by the spec owner") == 0
    text = doc(repo)
    assert text.count(loop.CONTRACT_BEGIN) == 1 and "reference docstring fixed by the spec owner" in text
    c = loop.read_contract(text)
    assert c["reopened"][0]["reason"] == "reference docstring fixed by the spec owner"
    assert c["reopened"][0]["changed"] == ["src/tileport/ops/fake/reference.py (changed)"]
    assert c["first_recorded"]


def test_try_refuses_changed_reference_or_tests(repo, capsys):
    assert run(repo, "start", "fake") == 0
    capsys.readouterr()
    rows = len(loop.read_log(doc(repo)))
    (repo / "src" / "tileport" / "ops" / "fake" / "reference.py").write_text(REFERENCE.replace("2", "3"))
    (repo / "tests" / "test_fake_parity.py").write_text(PARITY + "\n# loosened\n")
    (repo / "tests" / "test_fake_extra.py").write_text("def test_y():\n    pass\n")
    assert run(repo, "try", "faster", "--op", "fake", "--gate-cmd", "true", "--no-bench") == 2
    err = capsys.readouterr().err
    assert "src/tileport/ops/fake/reference.py (changed)" in err
    assert "tests/test_fake_parity.py (changed)" in err and "tests/test_fake_extra.py (new test file)" in err
    assert "--reopen" in err
    assert len(loop.read_log(doc(repo))) == rows  # nothing logged
    # re-opened on purpose: try goes ahead
    assert run(repo, "start", "fake", "--reopen", "new test file for varlen") == 0
    assert run(repo, "try", "faster", "--op", "fake", "--gate-cmd", "true", "--no-bench") == 0


def test_try_gate_failed_logged_and_nonzero(repo, capsys, monkeypatch):
    assert run(repo, "start", "fake") == 0
    called = []
    monkeypatch.setattr(loop, "_run_bench", lambda *a: called.append(a))  # must never be reached
    rc = run(repo, "try", "unrolled the loop: predict 2x fwd", "--op", "fake", "--gate-cmd", "false")
    assert rc == 1 and not called
    row = loop.read_log(doc(repo))[-1]
    assert row["version"] == "loop 1" and row["prediction"] == "unrolled the loop: predict 2x fwd"
    assert row["outcome"].startswith("GATE FAILED") and "no speedup claimed" in row["outcome"]
    assert " ms" not in row["outcome"]


def test_try_appends_row_with_prediction(repo, capsys, monkeypatch):
    monkeypatch.delenv("TILEPORT_COMMIT", raising=False)
    assert run(repo, "start", "fake") == 0
    (repo / "src" / "tileport" / "ops" / "fake" / "kernels.py").write_text("# new kernel\n")
    pred = "wider tiles | predict fwd -20% (0.8 ms)"
    assert run(repo, "try", pred, "--op", "fake", "--gate-cmd", "true", "--no-bench") == 0
    text = doc(repo)
    rows = loop.read_log(text)
    assert [r["version"] for r in rows] == ["v0", "loop 1"]  # appended to the table, after the hand row
    r = rows[-1]
    assert r["prediction"] == pred  # the | survives (escaped in the markdown)
    assert r["commit"] == _git(repo, "rev-parse", "--short", "HEAD")
    assert r["card"] == loop._gpu()[1] and "ops/fake/kernels.py" in r["change"]
    assert r["outcome"].startswith("gate passed") and "no bench" in r["outcome"]
    assert text.index("| loop 1 |") < text.index("## Notes after the log")
    assert run(repo, "try", "second", "--op", "fake", "--gate-cmd", "true", "--no-bench") == 0
    assert loop.read_log(doc(repo))[-1]["version"] == "loop 2"


def test_try_with_bench_record_and_report(repo, capsys, monkeypatch):
    assert run(repo, "start", "fake") == 0
    c = loop.read_contract(doc(repo))
    floor_fwd = next(f["floor_ms"] for f in c["floors"] if f["mode"] == "fwd")
    shape = {"N": 1 << 20, "D": 256}
    record = {"args": {"dtype": "bf16"}, "machine": {"gpu": "NVIDIA H200", "commit": "abc1234"},
              "rows": [{"op": "fake", "shape": shape, "mode": "fwd", "system": "triton", "status": "ok",
                        "ms": 2 * floor_fwd, "graph_ms": 1.5 * floor_fwd},
                       {"op": "fake", "shape": shape, "mode": "fwd", "system": "gluon",
                        "status": "refuses: RuntimeError: no"}],
              "base": {"ref": "HEAD", "commit": "abc1234",
                       "comparison": [{"op": "fake", "shape": shape, "mode": "fwd", "system": "triton",
                                       "before_ms": 2.5 * floor_fwd, "after_ms": 2 * floor_fwd, "speedup": 1.25}]}}
    monkeypatch.setattr(loop, "_run_bench", lambda op, args, gpu: (0, record, ""))
    assert run(repo, "try", "cache the norm: predict x1.2 fwd", "--op", "fake", "--gate-cmd", "true") == 0
    row = loop.read_log(doc(repo))[-1]
    assert row["card"] == "NVIDIA H200"
    assert f"triton fwd N1048576,D256 {2 * floor_fwd:.3f} ms" in row["outcome"] and "x1.25" in row["outcome"]
    assert "gluon fwd N1048576,D256: refuses" in row["outcome"]
    assert run(repo, "try", "broke it", "--op", "fake", "--gate-cmd", "exit 3") == 1
    capsys.readouterr()

    assert run(repo, "report", "fake", "--last", "5") == 0
    out = capsys.readouterr().out
    assert "HOLDS" in out and "src/tileport/ops/fake/reference.py" in out
    assert "benchmarks/results/new.json" in out
    assert "| loop 1 |" in out and "cache the norm: predict x1.2 fwd" in out
    assert "| loop 1 | triton | fwd | N1048576,D256 |" in out and "| x1.25 | 1.000 | 50% |" in out
    assert "| loop 2 |" in out and "FAILED" in out
    # coverage from pytest's collection of tests/test_fake_*.py
    assert "| axis | reference | triton |" in out
    assert "| test: test_forward_backward | 2 | 2 |" in out
    assert "| dtype: bf16 | 1 | 1 |" in out and "| feature: varlen | 1 | 1 |" in out and "| shape: N8-D4 |" in out
    assert "test: test_state_extremes: no triton case" in out
    risks = out.split("## Open risks", 1)[1]
    assert "gate failures: loop 2 (including the latest)" in risks
    assert "rows without GPU timings: loop 2" in risks


def test_gate_and_bench_in_two_calls(repo, capsys, monkeypatch):
    """`try --no-bench` then `try --bench-only` (the gate and the bench in two device calls): one
    log row, its outcome the gate's and then the bench's; refused without such a row, after a
    commit, or with both flags."""
    assert run(repo, "start", "fake") == 0
    assert run(repo, "try", "x", "--op", "fake", "--gate-cmd", "true", "--bench-only") == 2  # no gate row yet
    assert run(repo, "try", "predict x1.1", "--op", "fake", "--gate-cmd", "true", "--no-bench") == 0
    rows = loop.read_log(doc(repo))
    assert f"no bench (--no-bench) [tree {loop.tree_digest(repo)}]" in rows[-1]["outcome"]
    # a commit of docs alone (the gate's row brought back from the device) keeps the gate valid
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "the gate's row")
    assert run(repo, "try", "x", "--op", "fake", "--no-bench", "--bench-only") == 2
    shape = {"N": 1 << 20, "D": 256}
    record = {"args": {"dtype": "bf16"}, "machine": {"gpu": "NVIDIA H200", "commit": "abc1234"},
              "rows": [{"op": "fake", "shape": shape, "mode": "fwd", "system": "triton", "status": "ok",
                        "ms": 1.0, "graph_ms": 0.9}]}
    ran = []
    monkeypatch.setattr(loop, "_run_bench", lambda op, args, gpu: (ran.append(1), (0, record, ""))[1])
    assert run(repo, "try", "ignored", "--op", "fake", "--bench-only") == 0
    after = loop.read_log(doc(repo))
    assert len(after) == len(rows) and after[-1]["version"] == rows[-1]["version"] and ran == [1]
    assert after[-1]["prediction"] == "predict x1.1" and after[-1]["card"] == "NVIDIA H200"
    assert after[-1]["outcome"].startswith("gate passed (") and "bench in a second call: " in after[-1]["outcome"]
    assert "triton fwd N1048576,D256 1.000 ms" in after[-1]["outcome"] and "--no-bench" not in after[-1]["outcome"]
    assert "[tree" not in after[-1]["outcome"]
    # that row has its bench now: a second --bench-only is refused, as is one after a new commit
    assert run(repo, "try", "x", "--op", "fake", "--bench-only") == 2
    assert run(repo, "try", "again", "--op", "fake", "--gate-cmd", "true", "--no-bench") == 0
    (repo / "src" / "tileport" / "ops" / "fake" / "kernel.py").write_text("X = 1\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "a kernel change after the gate")
    assert run(repo, "try", "x", "--op", "fake", "--bench-only") == 2
    assert ran == [1]
    capsys.readouterr()


def test_report_names_a_broken_contract(repo, capsys):
    assert run(repo, "start", "fake") == 0
    (repo / "tests" / "test_fake_parity.py").unlink()
    capsys.readouterr()
    assert run(repo, "report", "fake", "--no-collect") == 0
    out = capsys.readouterr().out
    assert "BROKEN: tests/test_fake_parity.py (removed)" in out
    assert "no gated attempt logged" in out


def test_unknown_op_and_missing_contract_refused(repo, capsys):
    assert run(repo, "start", "nope") == 2
    assert "unknown op 'nope'" in capsys.readouterr().err
    assert run(repo, "try", "x", "--op", "fake", "--gate-cmd", "true") == 2
    assert "run `tileport loop start fake` first" in capsys.readouterr().err


def test_commit_from_environment_without_git(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEPORT_COMMIT", "feedbee")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert loop.commit_id(tmp_path) == "feedbee"


def test_commit_from_environment_over_a_stale_git(repo, capsys, monkeypatch):
    # the device copy's .git lags the tree: the row names TILEPORT_COMMIT and claims no change list
    assert run(repo, "start", "fake") == 0
    (repo / "src" / "tileport" / "ops" / "fake" / "kernels.py").write_text("# new kernel\n")
    monkeypatch.setenv("TILEPORT_COMMIT", "feedbee")
    assert loop.commit_id(repo) == "feedbee"
    assert run(repo, "try", "x", "--op", "fake", "--gate-cmd", "true", "--no-bench") == 0
    row = loop.read_log(doc(repo))[-1]
    assert row["commit"] == "feedbee" and "uncommitted" not in row["commit"]
    assert "stale" in row["change"] and "kernels.py" not in row["change"]
    head = loop._git(repo, "rev-parse", "HEAD")
    monkeypatch.setenv("TILEPORT_COMMIT", head[:7])  # the same commit as HEAD: git's own answer stands
    assert loop.commit_id(repo).startswith(head[:7])


def test_report_says_what_changed_since_the_gated_commit(repo, capsys, monkeypatch):
    monkeypatch.delenv("TILEPORT_COMMIT", raising=False)
    assert run(repo, "start", "fake") == 0
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "contract")
    assert run(repo, "try", "x", "--op", "fake", "--gate-cmd", "true", "--no-bench") == 0
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "row")
    (repo / "src" / "tileport" / "helper.py").write_text("# shared, not the op's\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "helper")
    capsys.readouterr()
    assert run(repo, "report", "fake") == 0
    out = capsys.readouterr().out
    assert "src/tileport/helper.py; none of them this op's code or contract" in out
    (repo / "src" / "tileport" / "ops" / "fake" / "kernels.py").write_text("# the op's\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "kernel")
    assert run(repo, "report", "fake") == 0
    assert "1 of them this op's code or contract: src/tileport/ops/fake/kernels.py" in capsys.readouterr().out


def test_an_ops_code_includes_the_op_folders_it_imports(repo):
    other = repo / "src" / "tileport" / "ops" / "other"
    other.mkdir()
    (other / "kernels.py").write_text("# shared kernels\n")
    (repo / "src" / "tileport" / "ops" / "fake" / "kernels.py").write_text("from ..other import kernels\n")
    assert loop.Op(repo, "fake").code_dirs() == ["src/tileport/ops/fake/", "src/tileport/ops/other/"]


def test_pytest_summary_and_id_axes():
    out = "FAILED tests/t.py::test_a[x] - AssertionError\n1 failed, 75 passed, 27 skipped, 153 warnings in 5.78s\n"
    assert loop.pytest_summary(out) == "1 failed, 75 passed, 27 skipped"
    assert loop.pytest_failures(out) == ["tests/t.py::test_a[x]"]
    c = loop.classify("tests/test_attnres_parity.py::test_forward_backward[outnorm-L3-2x37-D96-bf16-gluon]")
    assert (c["backend"], c["dtypes"], c["shape"], c["features"], c["direction"]) == \
        ("gluon", ["bf16"], "L3-2x37-D96", ["outnorm"], "fwd+bwd")
    c = loop.classify("tests/test_gdn_errors.py::test_bad_input_raises_naming_the_argument[k shape]")
    assert c["direction"] == "input validation" and c["backend"] is None and c["features"] == []
