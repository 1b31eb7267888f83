"""`OutputText` (the one detokenization of a request's output, its stop strings and streamed deltas) against
a reference written from its definition, on the tiny model's real byte-level BPE tokenizer: seeded random
token sequences mixing whole words, single bytes (UTF-8 split across tokens, invalid sequences) and special
tokens; stop strings cut from the text (straddling tokens, overlapping, of mixed lengths), with and without
min_tokens, include_stop_str_in_output and skip_special_tokens."""

import random

import pytest

from torpor.engine.sampling_params import SamplingParams
from torpor.engine.tokenizer import OutputText, Tokenizer

SPECIAL = (1021, 1022, 1023)  # <|endoftext|>, <|im_start|>, <|im_end|>


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_path)


def run(tokenizer: Tokenizer, ids: list[int], params: SamplingParams, stream: bool = True):
    """Feed `ids` one token per step as the engine does: (final text, concatenated deltas, stop string,
    tokens consumed)."""
    text = OutputText(tokenizer, params, stream)
    deltas, stop, used = [], None, len(ids)
    for k in range(1, len(ids) + 1):
        stop = text.update(ids[:k])
        if stop is not None:
            used = k
            break
        deltas.append(text.delta())
    final = text.final(ids[:used])
    deltas.append(text.delta(final))
    return final, "".join(deltas), stop, used


def reference(tokenizer: Tokenizer, ids: list[int], params: SamplingParams) -> tuple[str, str | None]:
    """vLLM's rule: the text after k tokens is the decode of the longest prefix that does not end in an
    unfinished character; once more than min_tokens tokens are out, each stop string is looked for where it
    could end in the text new at this token (it may begin up to len(stop) - 1 characters before it); the
    earliest match ends the text (before it, or after it with include_stop_str_in_output)."""
    skip = params.skip_special_tokens
    old = ""
    for k in range(1, len(ids) + 1):
        new = tokenizer.decode(ids[:k], skip)
        if new.endswith("\ufffd") or len(new) <= len(old):
            continue
        if k > params.min_tokens:
            hits = [(i, s) for s in params.stop if (i := new.find(s, max(0, len(old) - len(s) + 1))) != -1]
            if hits:
                index, stop = min(hits)
                return new[:index + len(stop)] if params.include_stop_str_in_output else new[:index], stop
        old = new
    return tokenizer.decode(ids, skip), None


def random_case(rng: random.Random, tokenizer: Tokenizer, with_min_tokens: bool):
    ids = [rng.choice([rng.randrange(1021), rng.randrange(256), rng.choice(SPECIAL)])
           for _ in range(rng.randint(1, 20))]
    skip = rng.random() < 0.5
    full = tokenizer.decode(ids, skip)
    stops = []
    for _ in range(rng.randint(0, 3) if full else 0):
        start = rng.randrange(len(full))
        stop = full[start:start + rng.randint(1, 8)]
        if "\ufffd" not in stop:
            stops.append(stop)
    if stops and rng.random() < 0.5:
        stops.append("never-in-the-text-" * rng.randint(1, 3))  # a long one: the longest sets the hold-back
    min_tokens = rng.randint(0, len(ids)) if with_min_tokens else 0
    params = SamplingParams(stop=stops, skip_special_tokens=skip, include_stop_str_in_output=rng.random() < 0.3,
                            min_tokens=min_tokens, max_tokens=32)
    return ids, params


@pytest.mark.parametrize("with_min_tokens", [False, True])
def test_text_and_deltas_equal_the_reference(tokenizer, with_min_tokens):
    rng = random.Random(11 + with_min_tokens)
    for _ in range(600):
        ids, params = random_case(rng, tokenizer, with_min_tokens)
        final, streamed, stop, used = run(tokenizer, ids, params)
        expected, expected_stop = reference(tokenizer, ids, params)
        case = (ids, params)
        assert (final, stop) == (expected, expected_stop), case
        assert streamed == final, case
        if stop is None:
            assert final == tokenizer.decode(ids, params.skip_special_tokens) and used == len(ids), case
            # without streaming and stop strings the text is one decode at the end: the same text
            assert run(tokenizer, ids, params, stream=False)[0] == final, case


def test_a_stop_string_seen_before_min_tokens_does_not_end_the_output_later(tokenizer):
    """"a" lies in the text of the first min_tokens tokens; a longer stop string beside it must not make
    the check after min_tokens look back far enough to find it (vLLM looks back len(stop) - 1 characters
    per stop string)."""
    ids = tokenizer.encode(" a b c d e f")
    params = SamplingParams(stop=["a", "a much longer stop string"], min_tokens=3, max_tokens=16)
    final, streamed, stop, _ = run(tokenizer, ids, params)
    assert (final, stop) == (" a b c d e f", None) and streamed == final


def test_multibyte_characters_split_across_tokens(tokenizer):
    text = "日本語 😀 é"
    single_byte = {raw[0]: i for i in range(1021) if len(raw := tokenizer.token_bytes(i)) == 1}
    ids = [single_byte[b] for b in text.encode("utf-8")]  # one token per byte
    assert tokenizer.decode(ids) == text
    for stops in ((), ("😀",), ("語 ",), ("\U0001f600 é",)):
        params = SamplingParams(stop=list(stops), max_tokens=32)
        final, streamed, stop, _ = run(tokenizer, ids, params)
        assert final == (text[:text.index(stops[0])] if stops else text) and streamed == final
        assert stop == (stops[0] if stops else None)
