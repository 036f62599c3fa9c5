"""`import attnres` against `import torch; from transformers import AutoModelForCausalLM`, side by side.

Each repeat times one fresh interpreter per statement, back to back, so both see the same load on the machine; the
ratio is the median of the per-repeat ratios.

    python -m benchmarks.import_time               # 7 repeats
    python -m benchmarks.import_time --repeats 15
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

BASELINE = "import torch; from transformers import AutoModelForCausalLM"
OURS = "import attnres"


def seconds(statement: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7, help="pairs of fresh interpreters (default: %(default)s)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats: expected at least 1, got {args.repeats}")
    pairs = [(seconds(BASELINE), seconds(OURS)) for _ in range(args.repeats)]
    base, ours = (statistics.median(times) for times in zip(*pairs))
    ratio = statistics.median(o / b for b, o in pairs)
    print(f"{BASELINE!r}: {base:.2f} s (median of {args.repeats})")
    print(f"{OURS!r}: {ours:.2f} s (median of {args.repeats})")
    print(f"ratio: {ratio:.2f}x (median of the per-repeat ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
