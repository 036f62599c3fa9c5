"""`attnres estimate`: bank memory and residual-path traffic of a Block AttnRes configuration."""

from __future__ import annotations

from attnres.analysis.cost import DTYPE_BYTES, hop_bytes_per_microbatch, residual_cost, tp_layer_bytes


def register(sub) -> None:
    p = sub.add_parser(
        "estimate",
        help="bank memory and residual traffic of a Block AttnRes model, to choose the block size",
        description="Prints the per-forward bank memory T*N*d*e, its share per rank under token sharding and per "
        "chunk under chunked prefill, and the residual-path traffic per token per sublayer (paper Table 1).",
    )
    p.add_argument("--tokens", type=int, default=8192, help="tokens of one forward, T (default: 8192)")
    p.add_argument("--layers", type=int, default=64, help="decoder layers (default: 64)")
    p.add_argument("--block-size", type=int, default=8, help="block size in decoder layers (default: 8)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size d (default: 7168)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_BYTES), help="bank dtype (default: bf16)")
    p.add_argument("--ranks", type=int, default=1, help="ranks sharing the tokens (default: 1)")
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk in tokens (default: no chunking)")
    p.add_argument("--tp", type=int, default=1,
                   help="training with tensor + sequence parallel over this many ranks: the bytes its collectives take "
                   "per decoder layer and step (default: 1, none)")
    p.add_argument("--pp", type=int, default=1,
                   help="training with this many pipeline stages: the bytes each hop sends per microbatch "
                   "(default: 1, none)")
    p.add_argument("--micro-batch", type=int, default=1,
                   help="sequences per microbatch (pipeline) or per tensor-parallel group (default: 1)")
    p.set_defaults(func=run)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def run(args) -> int:
    cost = residual_cost(args.tokens, args.layers, args.block_size, args.hidden, args.dtype, args.ranks, args.chunk)
    n_blocks = -(-args.layers // args.block_size)
    print(f"Block AttnRes: {args.layers} decoder layers, block size {args.block_size} -> N = {n_blocks} bank rows")
    print(f"  bank, one forward of {args.tokens} tokens:   {_mib(cost.bank_bytes)}")
    print(f"  per rank, tokens sharded over {args.ranks}:     {_mib(cost.bank_bytes_per_rank)}")
    print(f"  per prefill chunk of {args.chunk or args.tokens} tokens:   {_mib(cost.bank_bytes_per_chunk)}")
    print("Residual-path traffic per token per sublayer (units of d elements):")
    print(f"  standard residual     {cost.traffic_standard:.2f} d")
    print(f"  Block, two-phase      {cost.traffic_block_two_phase:.2f} d")
    print(f"  Full, two-phase       {cost.traffic_full_two_phase:.2f} d")
    e = DTYPE_BYTES[args.dtype]
    if args.tp > 1:
        per_layer = tp_layer_bytes(args.micro_batch, args.tokens, args.hidden, e, args.tp)
        print(f"Tensor + sequence parallel over {args.tp} ranks, {args.micro_batch} sequence(s) of {args.tokens} tokens:")
        print(f"  collectives of one decoder layer, one training step, per rank: {_mib(per_layer)}")
        print(f"  all {args.layers} decoder layers: {_mib(per_layer * args.layers)}")
    if args.pp > 1:
        if args.layers % args.pp:
            raise ValueError(f"pp: {args.pp} stages must divide layers={args.layers}")
        hops = hop_bytes_per_microbatch("block", args.layers, args.pp, 1, args.block_size, args.micro_batch,
                                        args.tokens, args.hidden, e)
        print(f"Pipeline of {args.pp} stages, microbatch of {args.micro_batch} sequence(s) of {args.tokens} tokens "
              f"(Block; each rank's tokens under tensor parallel: pass --tokens T/tp):")
        print("  bytes each hop sends per microbatch: " + ", ".join(_mib(b) for b in hops))
    return 0
