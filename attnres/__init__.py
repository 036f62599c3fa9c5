"""attnres: Attention Residuals, the residual sum replaced by a softmax attention over depth."""

from attnres.layers import DepthAttention, RMSNorm, make_stream
from attnres.ops import (
    SoftmaxStats,
    depth_attention,
    depth_stats,
    finish_stats,
    merge_prefix,
    merge_stats,
    naive_depth_attention,
    naive_depth_stats,
)

__version__ = "0.1.0"

__all__ = [
    "DepthAttention",
    "RMSNorm",
    "SoftmaxStats",
    "depth_attention",
    "depth_stats",
    "make_stream",
    "finish_stats",
    "merge_prefix",
    "merge_stats",
    "naive_depth_attention",
    "naive_depth_stats",
]

# The models import transformers (seconds), so they load on first use rather than with `import attnres`.
_MODELS = ("AttnResConfig", "AttnResForCausalLM", "AttnResModel", "convert_from_hf")
__all__ += list(_MODELS)


def __getattr__(name: str):
    if name in _MODELS:
        import attnres.models

        return getattr(attnres.models, name)
    raise AttributeError(f"module 'attnres' has no attribute {name!r}")
