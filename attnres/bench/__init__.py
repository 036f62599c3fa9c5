"""The benchmark suite behind `attnres bench`: operator, two-phase, fused inference and model-level cases,
each timed side by side with its baselines in one process, reported against the machine's copy bandwidth."""

from attnres.bench.config import SuiteConfig
from attnres.bench.suite import run_suite

__all__ = ["SuiteConfig", "run_suite"]
