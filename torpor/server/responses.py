"""OpenAI response bodies: completions and chat completions, whole or as stream chunks, with
logprobs in each endpoint's shape (the text, streamed deltas included, comes from the engine)."""

from __future__ import annotations

import time

from torpor.engine.outputs import RequestOutput, TokenLogprobs
from torpor.engine.routed_experts import encode


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens}


def _routed(routed_experts) -> dict:
    """A choice's `routed_experts` (asked for with `return_routed_experts`; format: torpor/engine/routed_experts.py)."""
    return {} if routed_experts is None else {"routed_experts": encode(routed_experts)}


class ResponseFormat:
    """The envelope shared by whole responses and chunks of one request."""

    object = chunk_object = ""

    def __init__(self, tokenizer, model_name: str, request_id: str, num_logprobs: int | None) -> None:
        self.tokenizer, self.model_name, self.request_id = tokenizer, model_name, request_id
        self.num_logprobs = num_logprobs
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model_name,
                "choices": choices, **extra}

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def response(self, output: RequestOutput | list[RequestOutput]) -> dict:
        """The whole response of one request, or of a batch of prompts (one output each): choice index =
        prompt index * n + sample index, as OpenAI and vLLM number them. Each choice (and chunk) carries
        vLLM's `stop_reason`: the stop string or stop token id that ended it, else null."""
        outputs = output if isinstance(output, list) else [output]
        choices, num_prompt_tokens, num_output_tokens = [], 0, 0
        for i, out in enumerate(outputs):
            num_prompt_tokens += len(out.prompt_token_ids)
            for completion in out.outputs:
                index = i * len(out.outputs) + completion.index
                choice = self._choice(completion.text, completion.token_ids, completion.logprobs,
                                      completion.finish_reason, whole=True, index=index)
                choices.append({**choice, "stop_reason": completion.stop_reason,
                                **_routed(completion.routed_experts)})
                num_output_tokens += len(completion.token_ids)
        return self._envelope(self.object, choices, usage=usage(num_prompt_tokens, num_output_tokens))

    def chunk(self, text: str, token_ids: list[int], logprobs: list[TokenLogprobs] | None,
              finish_reason: str | None, index: int = 0, stop_reason: int | str | None = None,
              routed_experts=None) -> dict:
        choice = self._choice(text, token_ids, logprobs, finish_reason, whole=False, index=index)
        return self._envelope(self.chunk_object, [{**choice, "stop_reason": stop_reason, **_routed(routed_experts)}])

    def usage_chunk(self, num_prompt_tokens: int, num_output_tokens: int) -> dict:
        return self._envelope(self.chunk_object, [], usage=usage(num_prompt_tokens, num_output_tokens))

    def opening_chunk(self, index: int = 0) -> dict | None:
        return None

    def _choice(self, text, token_ids, logprobs, finish_reason, whole: bool, index: int = 0) -> dict:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    """`text_completion`; logprobs as {tokens, token_logprobs, top_logprobs, text_offset}."""

    object = chunk_object = "text_completion"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._text_offsets: dict[int, int] = {}  # choice index -> offset of its next token, across chunks

    return_token_ids = False  # vLLM's `return_token_ids`: the sampled ids too (set per request)

    def _choice(self, text, token_ids, logprobs, finish_reason, whole: bool, index: int = 0) -> dict:
        choice = {"index": index, "text": text, "finish_reason": finish_reason,
                  "logprobs": self._logprobs(token_ids, logprobs, index) if self.num_logprobs is not None else None}
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def _logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs], index: int = 0) -> dict:
        tokens, offsets = [], []
        for token_id in token_ids:
            tokens.append(self.token_text(token_id))
            offsets.append(self._text_offsets.get(index, 0))
            self._text_offsets[index] = offsets[-1] + len(tokens[-1])
        # The engine gives the top-n plus the chosen token: all of them, most likely first.
        tops = [{self.token_text(t): v for t, v in sorted(lp.items(), key=lambda kv: -kv[1])} for lp in logprobs]
        return {"tokens": tokens, "token_logprobs": [lp[t] for t, lp in zip(token_ids, logprobs, strict=True)],
                "top_logprobs": tops, "text_offset": offsets}


class ChatFormat(ResponseFormat):
    """`chat.completion` / `chat.completion.chunk`; logprobs as {content: [{token, logprob, bytes,
    top_logprobs}]}, with exactly `top_logprobs` alternatives per token."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def opening_chunk(self, index: int = 0) -> dict:
        return self._envelope(self.chunk_object, [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}])

    def _choice(self, text, token_ids, logprobs, finish_reason, whole: bool, index: int = 0) -> dict:
        if whole:
            body = {"message": {"role": "assistant", "content": text}}
        else:
            body = {"delta": {"content": text} if text else {}}
        lps = self._logprobs(token_ids, logprobs) if self.num_logprobs is not None else None
        return {"index": index, **body, "logprobs": lps, "finish_reason": finish_reason}

    def _entry(self, token_id: int, logprob: float) -> dict:
        # `bytes`: the token's raw bytes (a byte-fallback or partial UTF-8 token is not U+FFFD's UTF-8)
        return {"token": self.token_text(token_id), "logprob": logprob,
                "bytes": list(self.tokenizer.token_bytes(token_id))}

    def _logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs]) -> dict:
        content = []
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            top = sorted(lp.items(), key=lambda kv: -kv[1])[: self.num_logprobs]
            content.append({**self._entry(token_id, lp[token_id]), "top_logprobs": [self._entry(t, v) for t, v in top]})
        return {"content": content}

