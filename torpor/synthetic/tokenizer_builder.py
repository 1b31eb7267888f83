"""A byte-level BPE tokenizer trained (deterministically) on the embedded corpus, with the special
tokens of a chat format at chosen ids, plus the matching tokenizer_config.json."""

import json
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from torpor.synthetic.corpus import CORPUS
from torpor.synthetic.presets import Preset


def build_tokenizer(preset: Preset) -> Tokenizer:
    """Learnt tokens get ids [0, tokenizer_vocab_size); special tokens `first_special_id + offset`."""
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
    # Special ids may leave holes (as the real Llama 3 / Qwen ids do): put them in the model vocab
    # itself, since `added_tokens` alone would be renumbered to follow the learnt tokens.
    spec = json.loads(tokenizer.to_str())
    for content, token_id in special_token_ids(preset).items():
        spec["model"]["vocab"][content] = token_id
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
