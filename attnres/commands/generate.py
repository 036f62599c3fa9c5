"""`attnres generate`: stream a continuation of a prompt from a saved AttnRes model or a training run folder."""

from __future__ import annotations

import torch


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="stream text from a saved AttnRes model (save_pretrained or `attnres convert` folder, or a training run)",
        description="Loads the folder's model with AutoModelForCausalLM and its tokenizer with AutoTokenizer "
        "(safetensors; no code is executed); a folder without a tokenizer gets the byte-level one of `attnres train`. "
        "A training run folder loads its final/ folder, or its latest checkpoint while it has none. Prints the "
        "prompt, then the continuation as it is generated, with the KV cache.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="model folder or training run folder")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens to generate at most, lowered (with a note on stderr) to the positions the model's "
                   "context leaves after the prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling probability mass (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default: %(default)s)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.set_defaults(func=run)


def run(args) -> int:
    from attnres.inference import generate_text, load_for_generation
    from attnres.progress import transformers_progress

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with transformers_progress(False):  # no "Loading weights" bar before the text
        model, tokenizer = load_for_generation(args.model, device)
    generate_text(
        model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed, echo_prompt=True
    )
    return 0
