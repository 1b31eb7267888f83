"""vLLM's `Logprob` entries for Python callers of `LLM`.

The engine keeps a position's logprobs as `{token id: logprob}` (the sampler's top-k plus the actual
token; bit-exact, torch-free, what the server formats). `LLM.generate` and `LLM.chat` hand them out as
`{token id: Logprob}` with the rank and the decoded token, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torpor.engine.outputs import RequestOutput, TokenLogprobs
    from torpor.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class Logprob:
    """One token's entry at one position.

    logprob: log-softmax of the model's raw logits. rank: 1 for the most likely token of the position;
    None for an actual token outside the requested top-k (the sampler ranks only the top-k).
    decoded_token: the token's text (special tokens included)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def position_logprobs(entries: TokenLogprobs, actual: int, num_top: int, decode) -> dict[int, Logprob]:
    """`{id: Logprob}` of one position. `entries` holds the top `num_top` plus the `actual` token (which
    is ranked only when it is one of the top); `decode(id)` gives a token's text."""
    top = [t for t in entries if t != actual] if len(entries) > num_top else list(entries)
    ranks = {token: i + 1 for i, token in enumerate(sorted(top, key=lambda t: -entries[t]))}
    return {token: Logprob(value, ranks.get(token), decode(token)) for token, value in entries.items()}


def with_logprob_objects(output: RequestOutput, tokenizer: Tokenizer, num_top: int | None,
                         num_prompt_top: int | None) -> RequestOutput:
    """A copy of `output` whose logprobs (output and prompt) are `{id: Logprob}` dicts."""
    texts: dict[int, str] = {}

    def decode(token: int) -> str:
        if token not in texts:
            texts[token] = tokenizer.decode([token], skip_special_tokens=False)
        return texts[token]

    completions = [c if c.logprobs is None or num_top is None else
                   replace(c, logprobs=[position_logprobs(e, t, num_top, decode)
                                        for e, t in zip(c.logprobs, c.token_ids, strict=True)])
                   for c in output.outputs]
    prompt_logprobs = output.prompt_logprobs
    if prompt_logprobs is not None and num_prompt_top is not None:
        prompt_logprobs = [None if e is None else position_logprobs(e, t, num_prompt_top, decode)
                           for e, t in zip(prompt_logprobs, output.prompt_token_ids, strict=True)]
    return replace(output, outputs=completions, prompt_logprobs=prompt_logprobs)
