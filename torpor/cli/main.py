"""The `torpor` command. Each subcommand lives in its own module and is imported lazily.

A failure the user can act on (a missing model, no CUDA, a path that cannot be written, no host
memory) is one line on stderr and exit code 1, never a traceback; TORPOR_TRACEBACK=1 shows it.
"""

from __future__ import annotations

import argparse
import sys

# What a subcommand raises for bad input or an unusable machine: said in one line.
USER_ERRORS = (OSError, ValueError, TypeError, RuntimeError, ImportError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torpor",
        description="Put a PyTorch LLM inference engine to sleep and wake it bit-identically.")
    parser.add_argument("--version", action="version", version=f"torpor {_version()}")
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
    from torpor.cli import bench_generate

    bench_generate.add_parser(bench_sub)
    from torpor.cli import bench_weights

    bench_weights.add_parser(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    name = " ".join(filter(None, ("torpor", args.command, getattr(args, "bench", None))))
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as exc:
        from torpor.env import Env

        if Env.read().traceback:
            raise
        print(f"{name}: error: {_one_line(exc)}", file=sys.stderr)
        return 1


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or "(no message)"
    return text if isinstance(exc, ValueError | RuntimeError) else f"{type(exc).__name__}: {text}"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torpor")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (not installed)"


if __name__ == "__main__":
    sys.exit(main())
