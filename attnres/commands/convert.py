"""`attnres convert`: turn a checkpoint of any PreNorm transformers decoder family (Llama, Mistral, Qwen, Gemma,
DeepSeek-V3, ...) into an AttnRes model computing the same function (zero pseudo-queries with the mixture rescale,
docs/design.md section 2), ready to fine-tune."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from attnres.layers.kinds import BLOCK, DEFAULT_BLOCK_SIZE, RESIDUAL_KINDS
from attnres.models.gguf import is_gguf

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


EXAMPLES = """\
examples:
  attnres convert path/to/llama_folder out/ --residual block --block-size 4
  attnres convert meta-llama/Llama-3.2-1B out/ --residual full --allow-download
  attnres convert SmolLM2-135M-Instruct.Q4_1.gguf out/ --block-size 5

  A GGUF file needs the gguf extra: pip install -e ".[gguf]".
"""


def register(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a transformers causal LM (any PreNorm decoder family) into an AttnRes model with the same outputs",
        description=textwrap.fill(
            "Converts SRC, a causal LM of a PreNorm transformers decoder family (Llama, Mistral, Qwen, Gemma, "
            "DeepSeek-V3, ...), into an AttnRes model that computes the same function, and writes it with SRC's "
            "tokenizer and chat template to the new folder DST (complete, or not at all). Every weight is copied key "
            "for key onto the family's own modules; the AttnRes parameters start at zero pseudo-queries and unit key "
            "gains with attn_res_rescale_mixture on, so the logits equal the original's to fp32 rounding, and "
            "fine-tuning then moves the queries. SRC loads with safetensors, never with remote code. A family whose "
            "decoder layer is not PreNorm (post-norm, parallel attention and MLP) is refused with the reason.",
            width=78, break_on_hyphens=False,
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", metavar="SRC",
                   help="a transformers model folder, a GGUF file (model.gguf: dequantized, its tokenizer and chat "
                   "template rebuilt from it), or a Hub name with --allow-download")
    p.add_argument("dst", metavar="DST", help="the folder to create for the AttnRes model (must not exist)")
    p.add_argument("--residual", choices=RESIDUAL_KINDS, default=BLOCK,
                   help="block: each sublayer reads a softmax attention over the sums of earlier blocks of decoder "
                   "layers and the current block's partial sum; full: over every earlier sublayer output; standard: "
                   "the plain residual sum, on the same code path (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help="Block AttnRes block size, counted in decoder layers (default: %(default)s)")
    p.add_argument("--no-rescale", action="store_true",
                   help="leave attn_res_rescale_mixture off (the Kimi K3 form): outputs then differ from the "
                   "original's by the RMSNorm eps")
    p.add_argument("--allow-download", action="store_true", help="let SRC be fetched from the Hugging Face Hub")
    p.set_defaults(func=run)


def run(args) -> int:
    from transformers import AutoModelForCausalLM

    from attnres.atomic import atomic_write_dir
    from attnres.models import convert_from_hf

    dst = Path(args.dst)
    if dst.exists():
        raise ValueError(f"dst: {dst} already exists; choose a new folder")
    overrides = {"attn_res_rescale_mixture": False} if args.no_rescale else {}
    if is_gguf(args.src):
        source, tokenizer = _load_gguf(args.src, args.residual, args.block_size, overrides)
    else:
        local_only = not args.allow_download
        if local_only and not Path(args.src).exists() and not _in_hub_cache(args.src):
            raise FileNotFoundError(f"src: no folder {args.src}; to fetch a Hugging Face Hub name, pass --allow-download")
        source = AutoModelForCausalLM.from_pretrained(args.src, local_files_only=local_only, trust_remote_code=False,
                                                      dtype="auto")
        tokenizer = _source_tokenizer(args.src, local_only)
    model = convert_from_hf(source, residual=args.residual, attn_res_block_size=args.block_size, **overrides)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)

    atomic_write_dir(dst, write)  # readers see no folder or the complete one
    config = model.config
    layout = f", {config.attn_res_block_size} decoder layers a block" if config.residual == BLOCK else ""
    print(
        f"converted {config.num_hidden_layers}-layer {source.config.model_type} to residual={config.residual}{layout} "
        f"-> {dst}{'' if tokenizer is None else ' (with its tokenizer)'}"
    )
    return 0


def _load_gguf(src: str, residual: str, block_size: int, overrides: dict):
    """The GGUF file's model and tokenizer, after the checks that need no weight: the file's layout, its architecture,
    its family's decoder layer (a family AttnRes cannot rewire is refused before anything is dequantized) and its
    tokenizer."""
    import torch

    from attnres.models import AttnResForCausalLM
    from attnres.models.convert import attnres_config_from_hf
    from attnres.models.gguf import gguf_config, load_gguf

    try:
        config = gguf_config(src)
        with torch.device("meta"):
            twin = AttnResForCausalLM(attnres_config_from_hf(config, residual, block_size, **overrides))
        twin.plan_layers()  # read from a small real twin of the family: refuses what is not PreNorm, with the reason
        return load_gguf(src, config=config)
    except ImportError as e:  # the optional packages that read GGUF files: one line naming the install command
        raise OSError(str(e)) from e


def _source_tokenizer(src: str, local_only: bool):
    """SRC's tokenizer, or None when it has none."""
    from transformers import AutoTokenizer

    if Path(src).is_dir():
        if not any((Path(src) / name).is_file() for name in TOKENIZER_FILES):
            return None
        return AutoTokenizer.from_pretrained(src, local_files_only=True)
    try:
        return AutoTokenizer.from_pretrained(src, local_files_only=local_only)
    except OSError:  # a Hub model without tokenizer files
        return None


def _in_hub_cache(name: str) -> bool:
    """Whether `name` is a Hugging Face Hub model already in the local cache (it loads without a network)."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except HFValidationError:  # not even a valid Hub name
        return False
