"""The device pointer tables of the Triton launchers are reused by content, and a table a CUDA graph captured is never
let go (its replays read it): the cache logic, with stand-in tables (no GPU here)."""

from __future__ import annotations


import triton  # noqa: F401 - a dev dependency: missing, the tests error

from attnres.ops.triton.depth_attention import TableCache  # noqa: E402


class Uploads:
    def __init__(self):
        self.count = 0

    def __call__(self):
        self.count += 1
        return ("host", f"table {self.count}")


def test_a_table_is_made_once_per_content_and_the_least_recent_goes_first():
    cache, make = TableCache(2), Uploads()
    first = cache.get("a", make, capturing=False)
    assert cache.get("a", make, capturing=False) is first and make.count == 1
    cache.get("b", make, capturing=False)
    cache.get("a", make, capturing=False)  # a is now the most recent
    cache.get("c", make, capturing=False)  # evicts b
    assert list(cache.recent) == ["a", "c"]
    cache.get("b", make, capturing=False)
    assert make.count == 4


def test_a_table_used_during_capture_is_kept_for_good():
    cache, make = TableCache(1), Uploads()
    warm = cache.get("warm", make, capturing=False)  # made in the warm-up
    assert cache.get("warm", make, capturing=True) is warm  # read by the capture: no copy
    fresh = cache.get("fresh", make, capturing=True)  # made during the capture
    for key in "xyz":
        cache.get(key, make, capturing=False)
    assert cache.get("warm", make, capturing=False) is warm
    assert cache.get("fresh", make, capturing=False) is fresh
    assert make.count == 5
