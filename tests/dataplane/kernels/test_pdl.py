"""When a launch uses programmatic dependent launch: on a device that supports it, for launches of
up to pdl.MAX_ROWS rows, unless switched off; the option is left out when off."""

import pytest
import torch

pytest.importorskip("triton")

from dataplane.kernels import pdl  # noqa: E402

ON = {"USE_PDL": True, "launch_pdl": True}
OFF = {"USE_PDL": False}


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(pdl, "_supported", lambda device_index: True)
    yield torch.device("cuda", 0)
    pdl.set_enabled(True)


def test_launches_up_to_max_rows_use_pdl(hopper):
    assert pdl.launch_options(hopper, 1) == ON
    assert pdl.launch_options(hopper, pdl.MAX_ROWS) == ON
    assert pdl.launch_options(hopper, pdl.MAX_ROWS + 1) == OFF


def test_switched_off_or_on_cpu_no_launch_uses_it(hopper):
    assert pdl.launch_options(torch.device("cpu"), 1) == OFF
    pdl.set_enabled(False)
    assert pdl.launch_options(hopper, 1) == OFF
