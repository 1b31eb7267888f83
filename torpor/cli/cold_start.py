"""One cold start, timed from inside a new process: `python -m torpor.cli.cold_start MODEL --device D
--options JSON` starts as the `torpor` command does (bytecode cache first), imports torch and torpor, builds
`LLM(MODEL, device=D, **options)`, generates one token and prints one JSON line: `imports_s`, the LLM's
`startup_phases`, `engine_s` (the LLM's construction), `first_token_s` and `ready_at` (wall-clock time of the
first token, for the parent's seconds from launch). `torpor bench sleep` runs it (bench_common.cold_start)."""

import time

START = time.perf_counter()  # before anything this module imports: what a restart pays for its imports

import argparse  # noqa: E402 - after the clock starts
import json  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torpor.cli.cold_start", description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--options", default="{}", help="LLM keyword arguments, a JSON object")
    args = parser.parse_args(argv)
    options = json.loads(args.options)
    if not isinstance(options, dict):
        parser.error(f"--options must be a JSON object, got {args.options!r}")
    # Imported here, after the clock started and the bytecode cache is set up: these imports are what is timed.
    from torpor.lazy import use_bytecode_cache

    use_bytecode_cache()
    from torpor import LLM, SamplingParams

    imports_s = time.perf_counter() - START
    built = time.perf_counter()
    llm = LLM(args.model, device=args.device, **options)
    engine_s = time.perf_counter() - built
    start = time.perf_counter()
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1))
    first_token_s = time.perf_counter() - start
    print(json.dumps({"imports_s": imports_s, "engine_s": engine_s, "first_token_s": first_token_s,
                      "startup_phases": llm.startup_phases, "ready_at": time.time()}), flush=True)
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
