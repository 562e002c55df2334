"""CUDA IPC end to end (tests/python/cuda_ipc_check.py) under pytest: skipped where there is no
GPU with PyTorch CUDA (as on CI); scripts/device-check.sh runs the same checks on a GPU machine."""

import pytest

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cuda_ipc_check as checks  # noqa: E402
from conftest import LIGHTWIRE_BIN, _serve_available  # noqa: E402

ok, why = checks.gpu_available()
pytestmark = pytest.mark.skipif(not ok, reason="no usable GPU: %s" % why)


@pytest.mark.parametrize("check", checks.CHECKS, ids=lambda c: c.__name__)
def test_cuda_ipc(check):
    available, reason = _serve_available()
    if not available:
        pytest.skip(reason)
    assert check(LIGHTWIRE_BIN)
