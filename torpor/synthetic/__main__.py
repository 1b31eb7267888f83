"""`python -m torpor.synthetic PRESET OUT_DIR [--seed N] [--dtype D]`: write a synthetic checkpoint."""

import argparse

from torpor.engine.config import DTYPE_NAMES
from torpor.synthetic.generator import DEFAULT_MAX_SHARD_BYTES, make_model
from torpor.synthetic.presets import PRESETS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("preset", choices=list(PRESETS))
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default=None)
    parser.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
    args = parser.parse_args()
    path = make_model(args.preset, args.out_dir, args.seed, args.dtype, max_shard_bytes=args.max_shard_bytes)
    print(path)


if __name__ == "__main__":
    main()
