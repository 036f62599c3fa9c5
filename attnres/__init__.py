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

# Importing the models registers "attnres" with transformers' Auto classes (AutoConfig, AutoModel,
# AutoModelForCausalLM), so `import attnres` is all a saved folder needs to load through them, and through the tools
# built on them (pipeline, Trainer, lm-evaluation-harness), without trust_remote_code. It imports transformers.
from attnres.models import AttnResConfig, AttnResForCausalLM, AttnResModel, convert_from_hf  # noqa: E402

__all__ += ["AttnResConfig", "AttnResForCausalLM", "AttnResModel", "convert_from_hf"]
