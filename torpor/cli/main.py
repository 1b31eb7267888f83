"""The `torpor` command. Each subcommand lives in its own module and is imported lazily, and the subcommands import
torch and the engine inside their functions: `torpor --help` answers at once and the bytecode cache
(`use_bytecode_cache`) is in place before torch loads. Every import inside a function under `torpor/cli/` is that.

A failure the user can act on (a missing model, no CUDA, a path that cannot be written, no host
memory) is one line on stderr and exit code 1, never a traceback; TORPOR_TRACEBACK=1 shows it.
"""

from __future__ import annotations

import argparse
import sys

from torpor.lazy import use_bytecode_cache

use_bytecode_cache()  # before any subcommand imports torch: this process is torpor's own
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
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the subcommand (its usage, its name), with the option meant when one is close
        command = _subcommand(parser, args)
        command.error(f"unrecognized arguments: {' '.join(unknown)}{_did_you_mean(command, unknown)}")
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


def _subcommand(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost parser the command line chose (`torpor bench sleep`: the `sleep` parser)."""
    for name in (args.command, getattr(args, "bench", None)):
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or name not in actions[0].choices:
            break
        parser = actions[0].choices[name]
    return parser


def _did_you_mean(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    import difflib

    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    for arg in unknown:
        close = difflib.get_close_matches(arg.split("=")[0], options, n=1) if arg.startswith("--") else []
        if close:
            return f" (did you mean {close[0]}?)"
    return ""


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
