"""Fixtures shared by unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_rank():
    """A one-rank gloo process group in this process (an in-memory store: no port), destroyed after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
