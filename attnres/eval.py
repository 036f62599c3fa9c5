"""`python -m attnres.eval ARGS`: EleutherAI's lm-evaluation-harness command line (`lm_eval ARGS`) with attnres loaded.

lm_eval's `hf` model loads its `pretrained=` folder through transformers' Auto classes. Importing attnres registers
the AttnRes classes with them, so the `final/` folder of an `attnres train` run, an `attnres convert` output or any
saved `AttnResForCausalLM` evaluates like any other model, without trust_remote_code:

    python -m attnres.eval run --model hf --model_args pretrained=runs/block-L6-d96-s0/final,backend=causal \\
        --tasks lambada_openai --device cpu

`backend=causal` tells lm_eval the model is decoder-only. lm_eval guesses that from transformers' built-in table of
causal model types, which a registered type is not in: without it, it logs "HF model type is neither marked as
CausalLM or Seq2SeqLM" and then takes causal anyway. Needs `pip install lm-eval`.
"""

from __future__ import annotations

import sys

import attnres  # noqa: F401  (registers the Auto classes)


def main(argv: list[str] | None = None) -> int:
    """Run lm_eval's command line on `argv` (default: this process's arguments)."""
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        print("python -m attnres.eval: needs EleutherAI's lm-evaluation-harness: pip install lm-eval", file=sys.stderr)
        return 2
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
