"""Tiny model configurations shared by the model tests."""

import pytest
import torch

from tests.models import TINY


@pytest.fixture
def tiny_config():
    """A factory of tiny `AttnResConfig`s (grouped-query attention: 4 query heads share 2 key/value heads)."""
    from attnres.models import AttnResConfig

    def make(**overrides) -> AttnResConfig:
        return AttnResConfig(**{**TINY, **overrides})

    return make


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls run far faster on one thread than on threads fighting over two shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
