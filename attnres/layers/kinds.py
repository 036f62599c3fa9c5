"""The residual kinds, and the default Block AttnRes block size: defined here only.

A residual kind is a plain string (it is what config.json and the command line carry); compare against these names.
"""

STANDARD = "standard"  # the family's own PreNorm residual sum, no AttnRes parameters
FULL = "full"  # every aggregation point attends over the embedding and every earlier sublayer output
BLOCK = "block"  # every point attends over the completed block summaries and the current block's partial sum
RESIDUAL_KINDS = (STANDARD, FULL, BLOCK)

# Decoder layers per block wherever none is given (AttnResConfig, conversion, `attnres train`): a model loaded from a
# PreNorm folder and one converted from it are then the same model.
DEFAULT_BLOCK_SIZE = 2
