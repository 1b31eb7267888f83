"""`torpor make-model PRESET OUT_DIR`: write a synthetic checkpoint in the exact Hugging Face layout
(config.json, generation_config.json, safetensors shards, tokenizer.json, tokenizer_config.json).
Deterministic: the same preset, seed and dtype give byte-identical files."""

from __future__ import annotations

import argparse
import time


def add_parser(sub: argparse._SubParsersAction) -> None:
    from torpor.engine.config import DTYPE_NAMES
    from torpor.synthetic import PRESETS

    p = sub.add_parser("make-model", help="write a synthetic Hugging Face checkpoint",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("preset", choices=list(PRESETS), help="model geometry")
    p.add_argument("out_dir", help="checkpoint folder (created if needed)")
    p.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                   help="weights dtype (default bfloat16)")
    p.add_argument("--config-only", action="store_true",
                   help="config and tokenizer, no weights: for an engine with load_format='dummy' (weights drawn on "
                        "the device; e.g. qwen3-30b-a3b's 61 GB where the disk cannot hold them)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from torpor.synthetic import make_model

    if Path(args.out_dir).exists() and not Path(args.out_dir).is_dir():
        raise ValueError(f"{args.out_dir} exists and is not a folder: give a checkpoint folder to create or refill")

    what = "config and tokenizer of preset" if args.config_only else "preset"
    print(f"writing {what} {args.preset!r} (seed {args.seed}, dtype {args.dtype or 'bfloat16'}) to {args.out_dir}")
    start = time.perf_counter()
    path = make_model(args.preset, args.out_dir, seed=args.seed, dtype=args.dtype, progress=True,
                      config_only=args.config_only)
    files = sorted(p for p in path.iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in files)
    print(f"wrote {len(files)} files, {total / 2**20:.1f} MiB in {time.perf_counter() - start:.1f} s: {path}")
    return 0


def preset_hint(model: str | None, command: str) -> str:
    """For a preset name given where a checkpoint goes (`torpor serve qwen3-0.6b`): how to make that checkpoint."""
    from pathlib import Path

    from torpor.synthetic import PRESETS

    if model not in PRESETS or Path(model).expanduser().exists():
        return ""
    return (f" ({model!r} is a torpor make-model preset: `torpor make-model {model} ./{model}`, then "
            f"`torpor {command} ./{model}`)")
