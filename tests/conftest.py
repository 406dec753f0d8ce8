import os
import secrets
import zlib

import pytest
import torch

from tileport.testing import test_device


def pytest_report_header(config):
    return (
        f"tileport: device={test_device()} TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')} "
        f"torch={torch.__version__} seed base={_SEED_BASE}"
    )


# Fresh inputs on every run; the base is printed in the header (and in failures) so a
# failing draw can be replayed with TILEPORT_SEED=<base>.
_SEED_BASE = int(os.environ.get("TILEPORT_SEED", secrets.randbits(31)))


@pytest.fixture
def seed(request):
    s = (_SEED_BASE + zlib.crc32(request.node.nodeid.encode())) % (2**31)
    torch.manual_seed(s)
    return s


@pytest.fixture
def device():
    return test_device()
