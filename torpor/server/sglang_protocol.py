"""SGLang's `/generate` request (`GenerateReqInput`) and its `sampling_params`, mapped onto torpor's
`SamplingParams` as SGLang means them (the table is in docs/server.md).

Inputs: `text` or `input_ids`, one prompt or a batch (a list); `n > 1` makes a batch of `n` samples per
prompt (prompt-major, as SGLang expands it). `sampling_params` (a dict, or one per prompt) takes SGLang's
names, a null value keeping SGLang's default: `max_new_tokens` (128; null: what the context leaves; 0:
the prompt is only read), `temperature` (below 1e-6 greedy), `top_p`, `top_k`, `min_p`,
`frequency_penalty`, `presence_penalty`, `min_new_tokens`, `stop`, `stop_token_ids` (dropped with
`ignore_eos`, as SGLang ignores them then), `ignore_eos`, `skip_special_tokens`, `no_stop_trim` (torpor's
`include_stop_str_in_output`), `n`, `logit_bias`, `sampling_seed` (or `seed`). Refused, because torpor's
meaning differs: `repetition_penalty` other than 1 (SGLang penalizes the output's tokens only, torpor the
prompt's too) and `min_new_tokens` with stop strings (SGLang lets a stop string end the output before it).
Refused, not built: `stop_regex`, `json_schema`, `regex`, `ebnf`, `structural_tag`, `custom_params`,
`stream_interval`, `spaces_between_special_tokens: false`.

Logprobs: `return_logprob` with `top_logprobs_num` (at most 20) gives the output's; `logprob_start_len`
(-1: none of the prompt's) the prompt's from that position. `token_ids_logprob` is refused (the engine
gives the top tokens, not chosen ones). Every other `GenerateReqInput` field is accepted at its default
(null / false / 0) and refused otherwise; a few carry no behaviour here and are accepted as they come
(`session_id`, `conversation_id`, `routing_key`, `priority`, `no_logs`, tracing headers); fields SGLang
does not have are refused by name.
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from torpor.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from torpor.server.errors import APIError, validation_error
from torpor.server.protocol import INT64_MAX, INT64_MIN

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
GREEDY_BELOW = 1e-6  # SGLang samples greedily below this temperature
# GenerateReqInput fields torpor does not implement: accepted only at these (SGLang's default) values.
DEFAULT_ONLY: dict[str, Any] = {
    "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None, "mm_hashes": None,
    "mm_content_hashes": None, "use_audio_in_video": False, "video_config": None, "return_sampling_mask": None,
    "return_flat_raw_top_logprobs": False, "return_flat_raw_top_logprobs_b64": False, "return_hidden_states": False,
    "return_routed_experts": False, "routed_experts_start_len": 0, "return_indexer_topk": False, "modalities": None,
    "session_params": None, "lora_path": None, "lora_id": None, "custom_logit_processor": None,
    "positional_embed_overrides": None, "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None,
    "bootstrap_pair_key": None, "decode_tp_size": None, "disagg_prefill_dp_rank": None, "kv_router_hint": None,
    "http_worker_ipc": None, "background": False, "require_reasoning": False, "max_thinking_tokens": None,
    "extra_key": None, "custom_labels": None, "return_bytes": False, "return_entropy": False,
    "need_wait_for_mm_inputs": None, "num_items_assigned": None, "encoder_urls": None, "max_dynamic_patch": None,
    "min_dynamic_patch": None, "image_max_dynamic_patch": None, "video_max_dynamic_patch": None,
    "images_config": None, "multi_item_delimiter_indices": None, "cache_salt": None, "token_ids_logprob": None,
}
# GenerateReqInput fields with no effect on one torpor server (identity, tracing, routing): accepted.
NO_EFFECT = frozenset({"session_id", "conversation_id", "routing_key", "priority", "no_logs", "external_trace_header",
                       "received_time"})
DP_RANK_FIELDS = ("routed_dp_rank", "data_parallel_rank")  # one data-parallel rank here: 0 or null
SAMPLING_DEFAULT_ONLY: dict[str, Any] = {"stop_regex": None, "json_schema": None, "regex": None, "ebnf": None,
                                         "structural_tag": None, "custom_params": None, "stream_interval": None,
                                         "spaces_between_special_tokens": True}


class SGLangSamplingParams(BaseModel):
    """One `sampling_params` dict (SGLang's names; null = SGLang's default)."""

    model_config = ConfigDict(extra="allow", strict=True)
    max_new_tokens: int | None = SGLANG_DEFAULT_MAX_NEW_TOKENS
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # an alias of sampling_seed

    def check(self, where: str) -> None:
        """400 naming `where.field` for a key torpor does not know or cannot honour as SGLang means it."""
        for name, value in (self.model_extra or {}).items():
            if name in SAMPLING_DEFAULT_ONLY:
                if value not in (None, SAMPLING_DEFAULT_ONLY[name]):
                    raise _unsupported(f"{where}.{name}", value)
            elif value is not None:
                raise APIError(400, f"{where}.{name}: SGLang's sampling params have no {name!r}",
                               param=f"{where}.{name}", code="unsupported_parameter")
        if self.repetition_penalty not in (None, 1.0):
            raise APIError(400, f"{where}.repetition_penalty={self.repetition_penalty!r} is not supported by torpor's "
                                "/generate: SGLang penalizes only the output's tokens, torpor the prompt's too (use "
                                "/v1/completions for vLLM's repetition_penalty)",
                           param=f"{where}.repetition_penalty", code="unsupported_parameter")
        if self.min_new_tokens and self.stop:
            raise APIError(400, f"{where}.min_new_tokens with stop strings is not supported by torpor: SGLang lets a "
                                "stop string end the output before min_new_tokens, torpor does not",
                           param=f"{where}.min_new_tokens", code="unsupported_parameter")
        if None not in (self.seed, self.sampling_seed) and self.seed != self.sampling_seed:
            raise APIError(400, f"{where}: seed and sampling_seed differ; give one", param=f"{where}.seed")

    @property
    def num_samples(self) -> int:
        return 1 if self.n is None else self.n

    def to_sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                           where: str) -> SamplingParams:
        temperature = 1.0 if self.temperature is None else self.temperature
        ignore_eos = bool(self.ignore_eos)
        try:
            return SamplingParams(
                temperature=0.0 if isinstance(temperature, int | float) and 0 <= temperature < GREEDY_BELOW
                else temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=-1 if self.top_k is None else self.top_k,
                min_p=self.min_p or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                presence_penalty=self.presence_penalty or 0.0, max_tokens=max_tokens,
                min_tokens=self.min_new_tokens or 0, stop=self.stop,
                stop_token_ids=None if ignore_eos else self.stop_token_ids, ignore_eos=ignore_eos,
                skip_special_tokens=True if self.skip_special_tokens is None else self.skip_special_tokens,
                include_stop_str_in_output=bool(self.no_stop_trim), logit_bias=self._logit_bias(where),
                seed=self.sampling_seed if self.sampling_seed is not None else self.seed, n=self.num_samples,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        except ValueError as exc:
            name = str(exc).split(" ", 1)[0]
            name = _SGLANG_NAMES.get(name, name)
            message = str(exc).replace("max_tokens", "max_new_tokens").replace("min_tokens", "min_new_tokens")
            raise APIError(400, f"{where}.{message}", param=f"{where}.{name}") from None

    def _logit_bias(self, where: str) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bad = [key for key in self.logit_bias if not key.strip().lstrip("+-").isdigit()]
        if bad:
            raise APIError(400, f"{where}.logit_bias keys must be token ids, got {bad[:5]}",
                           param=f"{where}.logit_bias")
        return {int(key): value for key, value in self.logit_bias.items()}


_SGLANG_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "seed": "sampling_seed",
                 "include_stop_str_in_output": "no_stop_trim"}


class GenerateRequest(BaseModel):
    """SGLang's `GenerateReqInput` (the fields torpor serves; see the module docstring for the rest)."""

    model_config = ConfigDict(extra="allow", strict=True)
    text: str | list[str] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    stream: bool = False
    log_metrics: bool = True

    def check_fields(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in NO_EFFECT:
                continue
            if name in DP_RANK_FIELDS:
                if value not in (None, 0):
                    raise APIError(400, f"{name}={value!r} out of range [0, 1): this server is one data-parallel "
                                        "rank", param=name)
            elif name in DEFAULT_ONLY:
                if value != DEFAULT_ONLY[name] and value not in (None, [], {}):
                    raise _unsupported(name, value)
            elif value is not None:
                raise APIError(400, f"unsupported field {name!r}: SGLang's /generate has no such field (send only "
                                    "GenerateReqInput's fields, or null)", param=name, code="unsupported_parameter")


@dataclass
class Item:
    """One prompt of a /generate request, its options normalized."""

    prompt: str | list[int]
    sampling: SGLangSamplingParams
    where: str  # the name of its sampling params in error messages
    rid: str
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int


def normalize(body: GenerateRequest) -> tuple[list[Item], bool]:
    """The request's prompts with their options, and whether it is a batch (a list is answered); 400s name
    what is wrong, with SGLang's messages where SGLang has one."""
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "Either text or input_ids should be provided (one of them).",
                       param="text" if body.text is not None else "input_ids")
    if body.input_ids is not None:
        if not body.input_ids:
            raise APIError(400, "input_ids cannot be empty.", param="input_ids")
        single = isinstance(body.input_ids[0], int)
        prompts: list = [body.input_ids] if single else list(body.input_ids)
        prompt_param = "input_ids"
    else:
        single = isinstance(body.text, str)
        prompts = [body.text] if single else list(body.text)
        prompt_param = "text"
    if not prompts:
        raise APIError(400, f"{prompt_param} is an empty batch", param=prompt_param)
    size = len(prompts)
    sampling = _per_item(body.sampling_params, size, "sampling_params", {})
    parsed = []
    for i, params in enumerate(sampling):
        where = "sampling_params" if not isinstance(body.sampling_params, list) else f"sampling_params.{i}"
        try:
            item = SGLangSamplingParams.model_validate(params)
        except ValidationError as exc:
            error = validation_error(exc.errors())
            raise APIError(400, f"{where}.{error.message}", param=f"{where}.{error.param}") from None
        item.check(where)
        parsed.append((item, where))
    if len({item.num_samples for item, _ in parsed}) > 1:
        raise APIError(400, "The parallel_sample_num should be the same for all samples in sample params.",
                       param="sampling_params")
    n = parsed[0][0].num_samples
    return_logprob = _per_item(body.return_logprob, size, "return_logprob", False)
    start = _per_item(body.logprob_start_len, size, "logprob_start_len", -1)
    top = _per_item(body.top_logprobs_num, size, "top_logprobs_num", 0)
    for value in top:
        if not 0 <= value <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs_num must be in [0, {MAX_LOGPROBS}], got {value}",
                           param="top_logprobs_num")
    for value in start:
        if value < -1:
            raise APIError(400, f"logprob_start_len must be -1 (the output only) or >= 0, got {value}",
                           param="logprob_start_len")
    items = [Item(prompt, item, where, rid, lp, s, t) for prompt, (item, where), rid, lp, s, t
             in zip(prompts, parsed, _rids(body.rid, size, single), return_logprob, start, top, strict=True)]
    return items, not single or n > 1


def _rids(rid: str | list[str] | None, size: int, single: bool) -> list[str]:
    """The engine request id of each prompt: `rid` itself for one prompt; `{rid}_{i}` or the listed ids for a
    batch (SGLang's naming); fresh hex ids when none is given."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(size)]
    if isinstance(rid, str):
        if not rid:
            raise APIError(400, "rid must be a non-empty string", param="rid")
        return [rid] if single else [f"{rid}_{i}" for i in range(size)]
    if single or len(rid) != size:
        raise APIError(400, "The specified rids length mismatch with the batch_size for batch processing.",
                       param="rid")
    duplicates = [value for value, count in Counter(rid).items() if count > 1]
    if duplicates:
        raise APIError(400, f"Duplicate request IDs detected within the request: {duplicates}", param="rid")
    if not all(rid):
        raise APIError(400, "rid must hold non-empty strings", param="rid")
    return list(rid)


def _per_item(value: Any, size: int, name: str, default: Any) -> list:
    """A per-prompt option: one value for all, or a list of one per prompt."""
    if value is None:
        return [default] * size
    if not isinstance(value, list):
        return [value] * size
    if len(value) != size:
        raise APIError(400, f"{name}: {len(value)} values for a batch of {size} prompts", param=name)
    return [default if v is None else v for v in value]


def _unsupported(name: str, value: Any) -> APIError:
    shown = value if not isinstance(value, str | bytes) or len(value) < 60 else f"{value[:60]!r}..."
    return APIError(400, f"{name}={shown!r} is not supported by torpor", param=name, code="unsupported_parameter")
