"""How far torpor's bf16 logits are from transformers' (bf16, eager experts) and from fp32, on greedy rollouts of
one synthetic preset: per prompt, the first step where the greedy tokens part, the top-two gap there, and over all
steps the |logprob| differences of the chosen tokens. It says whether a parting is a near-tie of bf16 rounding (the
gap within the logits' bf16 noise) or a real difference.

    python scripts/probe_bf16_vs_transformers.py --preset tiny-moe
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import transformers

from torpor import LLM, SamplingParams
from torpor.synthetic import make_model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny-moe")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=24)
    args = p.parse_args(argv)
    g = torch.Generator().manual_seed(2)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {d: str(make_model(args.preset, Path(tmp) / d, dtype=d, progress=False))
                 for d in ("bfloat16", "float32")}
        vocab = transformers.AutoConfig.from_pretrained(paths["float32"]).vocab_size
        prompts = [torch.randint(1, vocab, (int(n),), generator=g).tolist()
                   for n in torch.randint(3, 100, (args.prompts,), generator=g)]
        llm = LLM(paths["bfloat16"], device="cuda", max_model_len=256, max_num_seqs=16)
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, logprobs=0)
        outs = llm.generate(prompts, params, use_tqdm=False)
        extra = {"experts_implementation": "eager"} if "moe" in args.preset else {}  # the per-expert loop
        hf = {d: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, d), **extra).cuda().eval()
              for d, path in paths.items()}
        parted, diffs, hf_diffs, gaps = 0, [], [], []
        for prompt, out in zip(prompts, outs, strict=True):
            c = out.outputs[0]
            ids = torch.tensor([prompt + list(c.token_ids)[:-1]], device="cuda")
            with torch.inference_mode():
                lp = {d: torch.log_softmax(m(ids).logits[0, len(prompt) - 1:].float(), -1) for d, m in hf.items()}
            mine = torch.tensor([c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)], device="cuda")
            chosen = torch.tensor(c.token_ids, device="cuda")
            ref = lp["float32"].gather(-1, chosen[:, None])[:, 0]
            diffs.append((mine - ref).abs())
            hf_diffs.append((lp["bfloat16"].gather(-1, chosen[:, None])[:, 0] - ref).abs())
            top = lp["bfloat16"].topk(2, -1)
            f32top = lp["float32"].topk(2, -1)
            for step, token in enumerate(c.token_ids):
                if token != top.indices[step, 0].item():
                    parted += 1
                    gap = (top.values[step, 0] - top.values[step, 1]).item()
                    gaps.append(gap)
                    f32gap = (f32top.values[step, 0] - f32top.values[step, 1]).item()
                    print(f"prompt {len(prompt):3d} tokens: parts at step {step:2d}; transformers bf16 top two "
                          f"{top.indices[step].tolist()} gap {gap:.4f}, torpor {token}; fp32's top two "
                          f"{f32top.indices[step].tolist()} gap {f32gap:.4f}")
                    break
        d, h = torch.cat(diffs), torch.cat(hf_diffs)
        print(f"{args.preset}: {parted} of {len(prompts)} prompts part from transformers bf16 within {args.tokens} "
              "tokens")
        print(f"|logprob - fp32| of the chosen tokens: torpor bf16 mean {d.mean():.4f} max {d.max():.4f}; "
              f"transformers bf16 mean {h.mean():.4f} max {h.max():.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
