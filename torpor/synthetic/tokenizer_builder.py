"""A byte-level BPE tokenizer trained (deterministically) on the embedded corpus, with the special
tokens of a chat format at chosen ids, plus the matching tokenizer_config.json.

A real geometry's vocabulary (151,936 ids for Qwen3) is far larger than what the small corpus can teach,
and a synthetic model samples every id of it. So the ids the corpus does not fill get generated word
pieces ("Ġbrastel", "ound", "ĠWhimp": pseudo-words from English-like syllables, with or without a
leading space, drawn from a fixed seed): every id then decodes to readable (meaningless) text. Encoding
uses only the learnt merges, so the generated pieces never change how text is split."""

import json
import random
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from torpor.synthetic.corpus import CORPUS
from torpor.synthetic.presets import Preset

_ONSETS = ("", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "qu", "r", "s", "t", "v", "w", "y", "z",
           "bl", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gl", "gr", "pl", "pr", "sc", "sh", "sk", "sl", "sm", "sn",
           "sp", "st", "str", "sw", "th", "tr", "tw", "wh")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "ai", "au", "ea", "ee", "ie", "oa", "oo", "ou", "y")
_CODAS = ("", "", "", "b", "ck", "d", "ft", "g", "k", "l", "ld", "ll", "lt", "m", "mp", "n", "nd", "ng", "nk", "nt",
          "p", "r", "rd", "rk", "rm", "rn", "rt", "s", "sh", "sk", "ss", "st", "t", "th", "x")
_PIECE_SEED = 0x70727062  # fixed: the same pieces on every machine and Python version


def build_tokenizer(preset: Preset) -> Tokenizer:
    """Learnt tokens get ids [0, base_vocab_size); special tokens `first_special_id + offset`; every other id
    below the model's vocab_size a generated word piece (none for the tiny presets, which the learnt
    tokens and the special ids fill exactly)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=preset.tokenizer_vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
    if tokenizer.get_vocab_size() != preset.tokenizer_vocab_size:
        raise RuntimeError(
            f"the corpus yields {tokenizer.get_vocab_size()} BPE tokens, preset {preset.name!r} "
            f"needs {preset.tokenizer_vocab_size}"
        )
    spec = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    specials = special_token_ids(preset)
    free = sorted(set(range(preset.config["vocab_size"])) - set(vocab.values()) - set(specials.values()))
    vocab.update(zip(word_pieces(len(free), exclude=vocab.keys()), free, strict=True))
    # Special ids may leave holes (as the real Llama 3 / Qwen ids do): put them in the model vocab
    # itself, since `added_tokens` alone would be renumbered to follow the learnt tokens.
    for content, token_id in specials.items():
        vocab[content] = token_id
        spec["added_tokens"].append(
            {"id": token_id, "content": content, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
        )  # fmt: skip
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    bos = preset.chat_format.bos_token
    if bos is not None:  # Llama 3 style: encoding prepends bos
        bos_id = tokenizer.token_to_id(bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    return tokenizer


def word_pieces(count: int, exclude=frozenset()) -> list[str]:
    """`count` distinct pseudo-word pieces in the byte-level alphabet (a leading "Ġ" is a space), none in
    `exclude`; deterministic. Mostly word starts (" brastel", " Whimp"), some word continuations ("ound")."""
    rng, pieces, seen = random.Random(_PIECE_SEED), [], set(exclude)
    while len(pieces) < count:
        form = rng.random()
        syllables = 1 if form < 0.15 else rng.choice((1, 2, 2, 2, 3))
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
        piece = word if form < 0.15 else "Ġ" + (word.capitalize() if form < 0.25 else word)
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)
    return pieces


def special_token_ids(preset: Preset) -> dict[str, int]:
    start = preset.first_special_id
    return {content: start + offset for content, offset in preset.chat_format.special_tokens}


def tokenizer_config(preset: Preset) -> dict[str, Any]:
    fmt = preset.chat_format
    added = {
        str(token_id): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True}
        for content, token_id in special_token_ids(preset).items()
    }  # fmt: skip
    return {
        "add_bos_token": fmt.bos_token is not None,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": fmt.bos_token,
        "chat_template": fmt.chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": fmt.eos_token,
        "model_max_length": preset.config["max_position_embeddings"],
        "pad_token": fmt.pad_token,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
