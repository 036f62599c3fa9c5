"""transformers' own progress bars ("Loading weights", "Writing model shards"), switched for one block of work."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def transformers_progress(shown: bool) -> Iterator[None]:
    """transformers' progress bars as they are (`shown`) or off for the block, then as they were."""
    from transformers.utils import logging as hf_logging

    was_shown = hf_logging.is_progress_bar_enabled()
    if was_shown and not shown:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_shown and not shown:
            hf_logging.enable_progress_bar()
