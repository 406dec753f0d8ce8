"""The test harness itself (tests/conftest.py)."""


def test_xdist_workers_spread_over_the_gpus():
    """tests/conftest.py puts xdist worker gw<i> on GPU i mod n where a host has several, and leaves
    the current device alone on one GPU or outside xdist."""
    from conftest import xdist_worker_gpu

    assert [xdist_worker_gpu(f"gw{i}", 2) for i in range(5)] == [0, 1, 0, 1, 0]
    assert xdist_worker_gpu("gw7", 4) == 3
    assert xdist_worker_gpu("gw3", 1) is None  # one GPU
    assert xdist_worker_gpu("gw3", 0) is None  # none
    assert xdist_worker_gpu(None, 2) is None  # not under xdist
    assert xdist_worker_gpu("master", 2) is None


def test_sticky_cuda_errors_are_recognised():
    from tileport.testing import is_sticky_cuda_error

    assert is_sticky_cuda_error("AcceleratorError: CUDA error: an illegal memory access was encountered")
    assert is_sticky_cuda_error("RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered")
    assert is_sticky_cuda_error("RuntimeError: CUDA error: misaligned address")
    assert not is_sticky_cuda_error("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert not is_sticky_cuda_error("AssertionError: dq: rel error 3.1e-02 > bound 3.0e-02")


_POISONING_TESTS = '''
STATE = {"poisoned": False}


def test_a_faults():
    STATE["poisoned"] = True  # what a kernel fault does to the process: every later test here fails
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_b():
    assert not STATE["poisoned"]


def test_c():
    assert not STATE["poisoned"]


def test_d():
    assert not STATE["poisoned"]
'''


def _run_poisoning_tests(tmp_path, *pytest_args):
    import os
    import subprocess
    import sys

    import tileport

    src = os.path.dirname(os.path.dirname(os.path.abspath(tileport.__file__)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not this run's xdist worker
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))
    (tmp_path / "conftest.py").write_text("from tileport.testing import pytest_runtest_logfinish, "
                                          "pytest_runtest_makereport  # noqa: F401\n")
    (tmp_path / "test_poisoning.py").write_text(_POISONING_TESTS)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           *pytest_args, str(tmp_path / "test_poisoning.py")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)


def test_a_cuda_fault_ends_its_xdist_worker(tmp_path):
    """The faulting test fails (reported twice: its own failure and its worker's crash); the tests
    after it run in a fresh worker and pass, where they would all have failed in the poisoned one."""
    import pytest

    pytest.importorskip("xdist")
    run = _run_poisoning_tests(tmp_path, "-n", "1")
    out = run.stdout + run.stderr
    assert "3 passed" in out and "crashed while running 'test_poisoning.py::test_a_faults'" in out, out[-3000:]
    assert not any(f"FAILED test_poisoning.py::test_{t}" in out for t in "bcd"), out[-3000:]


def test_a_cuda_fault_stops_a_run_without_xdist(tmp_path):
    run = _run_poisoning_tests(tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 3, out[-3000:]
    assert "left this process's CUDA context unusable" in out and "1 failed" in out, out[-3000:]
