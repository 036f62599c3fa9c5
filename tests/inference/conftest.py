"""The model tests' tiny configurations, shared with the inference tests."""

from tests.models.conftest import one_thread, tiny_config  # noqa: F401
