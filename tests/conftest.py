import fcntl
import gc
import os
import secrets
import tempfile
import zlib

import pytest
import torch

from tileport.testing import test_device
from tileport.testing import pytest_runtest_logfinish, pytest_runtest_makereport  # noqa: F401 (hooks: a CUDA fault ends its worker)


def pytest_report_header(config):
    return (
        f"tileport: device={test_device()} TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')} "
        f"torch={torch.__version__} seed base={_SEED_BASE}"
    )


# Fresh inputs on every run; the base is printed in the header (and in failures) so a
# failing draw can be replayed with TILEPORT_SEED=<base>.
_SEED_BASE = int(os.environ.get("TILEPORT_SEED", secrets.randbits(31)))


def xdist_worker_gpu(worker: str | None, n_gpus: int) -> int | None:
    """The GPU an xdist worker ("gw<i>") runs its tests on: i mod n_gpus on a host with several
    GPUs (the nvidia-h200-x2 machine: 31 workers on 2 cards take the GDN gate in about half the
    time of 15 on one, where it has reached the device call's 600 s: 532 s at 65562c2); None on one
    GPU or outside xdist (the current device stays)."""
    if not worker or n_gpus < 2 or not worker.startswith("gw") or not worker[2:].isdigit():
        return None
    return int(worker[2:]) % n_gpus


def pytest_configure(config):
    gpu = xdist_worker_gpu(os.environ.get("PYTEST_XDIST_WORKER"),
                           torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if gpu is not None:
        torch.cuda.set_device(gpu)  # before any CUDA work: "cuda" tensors and launches go there


@pytest.fixture
def seed(request):
    s = (_SEED_BASE + zlib.crc32(request.node.nodeid.encode())) % (2**31)
    torch.manual_seed(s)
    return s


@pytest.fixture
def device():
    return test_device()


# GPU memory under pytest-xdist (scripts/gpu-check, `tileport loop try`: 15 workers on one card).
# Each worker's caching allocator keeps what its largest test needed (6-9 GB seen), and the
# full-size cases' float64 references need ~20 GB each: on 2026-11-30 (loop 2) 17 tests failed
# with CUDA out-of-memory, none on parity. So every test hands its cached blocks back when it ends,
# and at most one full-size case runs at a time on each GPU (a file lock per card shared by the workers).
@pytest.fixture(autouse=True)
def _gpu_memory_discipline(request):
    if not torch.cuda.is_available():
        yield
        return
    lock = None
    if "full_size" in request.node.nodeid:
        # one lock per GPU: on a host with several, each card runs one full-size case at a time
        lock = open(os.path.join(tempfile.gettempdir(),
                                 f"tileport-full-size-tests-gpu{torch.cuda.current_device()}.lock"), "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        yield
    finally:
        gc.collect()
        torch.cuda.empty_cache()
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_UN)
            lock.close()
