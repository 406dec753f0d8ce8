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
