import pytest
import torch


@pytest.fixture(autouse=True)
def seed() -> int:
    """Every test starts from the same random state, so failures reproduce and tolerances are measured, not lucky."""
    torch.manual_seed(0)
    return 0
