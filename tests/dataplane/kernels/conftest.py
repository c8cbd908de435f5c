import zlib

import pytest
import torch

from tests.dataplane.kernels.helpers import kernel_device


@pytest.fixture
def device() -> torch.device:
    """cuda when there is a device, cpu under TRITON_INTERPRET=1, else the test skips."""
    return kernel_device()


@pytest.fixture
def gen(request) -> torch.Generator:
    """Fresh random inputs for each test case, reproducible from its id."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
