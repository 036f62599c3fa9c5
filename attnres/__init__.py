"""attnres: Attention Residuals, the residual sum replaced by a softmax attention over depth."""

from attnres.layers import DepthAttention, RMSNorm, make_residual, make_stream
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
    "make_residual",
    "make_stream",
    "finish_stats",
    "merge_prefix",
    "merge_stats",
    "naive_depth_attention",
    "naive_depth_stats",
]

# Importing the models package registers "attnres" with transformers' Auto classes (AutoConfig, AutoModel,
# AutoModelForCausalLM), so `import attnres` is all a saved folder needs to load through them, and through the tools
# built on them (pipeline, Trainer, lm-evaluation-harness), without trust_remote_code. The model classes themselves
# load on first use (`attnres.models`).
import attnres.models  # noqa: E402

_FROM_MODELS = ("AttnResConfig", "AttnResForCausalLM", "AttnResModel", "convert_from_hf")
__all__ += list(_FROM_MODELS)


def __getattr__(name: str):
    if name in _FROM_MODELS:
        return getattr(attnres.models, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
