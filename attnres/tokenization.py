"""The byte-level tokenizer of `attnres train` as a transformers tokenizer.

Bytes are the tokens: id b is byte b, 256 ids, none reserved. The NUL byte (id 0) separates documents in training
(text files never hold it), so it is also the BOS, EOS and padding token: `tokenizer(text)` gives `[0, *utf8 bytes]`,
the start of a document as the model saw it in training, and `add_special_tokens=False` gives the bytes alone.

`byte_tokenizer()` builds a `PreTrainedTokenizerFast` (the `tokenizers` library: a byte-level normalizer, a BPE
model over the 256 byte symbols with no merges, a byte-level decoder), so `save_pretrained` writes plain
`tokenizer.json` / `tokenizer_config.json` files that `AutoTokenizer.from_pretrained` loads with no attnres code.
"""

from __future__ import annotations

import functools

BYTE_VOCAB_SIZE = 256
SEPARATOR_ID = 0  # the NUL byte: end of a document, and so BOS, EOS and padding


@functools.cache
def byte_symbols() -> tuple[str, ...]:
    """The token string of each id: the character standing for the byte in GPT-2's byte-to-unicode table (the one
    `tokenizers`' ByteLevel normalizer and decoder use), except NUL, whose token is NUL itself.

    NUL is the special token, matched in the raw text (`normalized=False`): so only a real NUL byte is id 0, never the
    character that stands for NUL in the table (U+0100, two bytes of text), and the ByteLevel decoder, which reads
    NUL as byte 0, decodes it back.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(BYTE_VOCAB_SIZE):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(BYTE_VOCAB_SIZE + extra)
            extra += 1
    symbols[SEPARATOR_ID] = chr(SEPARATOR_ID)
    return tuple(symbols[b] for b in range(BYTE_VOCAB_SIZE))


def byte_tokenizer(model_max_length: int | None = None):
    """A `PreTrainedTokenizerFast` whose ids are the UTF-8 bytes of the text (see the module docstring);
    `model_max_length`: the context of the model it goes with (default: unbounded)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    symbols = byte_symbols()
    backend = Tokenizer(models.BPE(vocab={s: b for b, s in enumerate(symbols)}, merges=[]))
    backend.normalizer = normalizers.ByteLevel()
    backend.decoder = decoders.ByteLevel()
    nul = symbols[SEPARATOR_ID]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{nul} $A", pair=f"{nul} $A {nul} $B", special_tokens=[(nul, SEPARATOR_ID)]
    )
    special = AddedToken(nul, special=True, normalized=False)
    length = {} if model_max_length is None else {"model_max_length": model_max_length}
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=special, eos_token=special, pad_token=special,
        clean_up_tokenization_spaces=False, **length,
    )


def is_byte_tokenizer(tokenizer) -> bool:
    """Whether `tokenizer` maps ids to bytes as `byte_tokenizer()` does (e.g. one loaded from a run's folder)."""
    try:
        return len(tokenizer) == BYTE_VOCAB_SIZE and tuple(
            tokenizer.convert_ids_to_tokens(list(range(BYTE_VOCAB_SIZE)))
        ) == byte_symbols()
    except (AttributeError, TypeError, ValueError):
        return False
