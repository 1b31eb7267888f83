"""The `torpor` command. Each subcommand lives in its own module and is imported lazily."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torpor",
        description="Put a PyTorch LLM inference engine to sleep and wake it bit-identically.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from torpor.cli import demo

    demo.add_parser(sub)
    from torpor.cli import make_model

    make_model.add_parser(sub)
    from torpor.cli import serve

    serve.add_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks that print measured numbers")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    from torpor.cli import bench_memory

    bench_memory.add_parser(bench_sub)
    from torpor.cli import bench_decode

    bench_decode.add_parser(bench_sub)
    from torpor.cli import bench_sleep

    bench_sleep.add_parser(bench_sub)
    from torpor.cli import bench_weights

    bench_weights.add_parser(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
