"""OpenAI response bodies: completions and chat completions, whole or as stream chunks, with
logprobs in each endpoint's shape, and the streamed text of a request."""

from __future__ import annotations

import time

from torpor.engine.outputs import RequestOutput, TokenLogprobs
from torpor.engine.tokenizer import IncrementalDetokenizer


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens}


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

    def response(self, output: RequestOutput) -> dict:
        completion = output.outputs[0]
        choice = self._choice(completion.text, completion.token_ids, completion.logprobs, completion.finish_reason,
                              whole=True)
        return self._envelope(self.object, [choice],
                              usage=usage(len(output.prompt_token_ids), len(completion.token_ids)))

    def chunk(self, text: str, token_ids: list[int], logprobs: list[TokenLogprobs] | None,
              finish_reason: str | None) -> dict:
        return self._envelope(self.chunk_object, [self._choice(text, token_ids, logprobs, finish_reason, whole=False)])

    def usage_chunk(self, num_prompt_tokens: int, num_output_tokens: int) -> dict:
        return self._envelope(self.chunk_object, [], usage=usage(num_prompt_tokens, num_output_tokens))

    def opening_chunk(self) -> dict | None:
        return None

    def _choice(self, text, token_ids, logprobs, finish_reason, whole: bool) -> dict:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    """`text_completion`; logprobs as {tokens, token_logprobs, top_logprobs, text_offset}."""

    object = chunk_object = "text_completion"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._text_offset = 0  # of the next token, across the chunks of a stream

    return_token_ids = False  # vLLM's `return_token_ids`: the sampled ids too (set per request)

    def _choice(self, text, token_ids, logprobs, finish_reason, whole: bool) -> dict:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason,
                  "logprobs": self._logprobs(token_ids, logprobs) if self.num_logprobs is not None else None}
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def _logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs]) -> dict:
        tokens, offsets = [], []
        for token_id in token_ids:
            tokens.append(self.token_text(token_id))
            offsets.append(self._text_offset)
            self._text_offset += len(tokens[-1])
        # The engine gives the top-n plus the chosen token: all of them, most likely first.
        tops = [{self.token_text(t): v for t, v in sorted(lp.items(), key=lambda kv: -kv[1])} for lp in logprobs]
        return {"tokens": tokens, "token_logprobs": [lp[t] for t, lp in zip(token_ids, logprobs, strict=True)],
                "top_logprobs": tops, "text_offset": offsets}


class ChatFormat(ResponseFormat):
    """`chat.completion` / `chat.completion.chunk`; logprobs as {content: [{token, logprob, bytes,
    top_logprobs}]}, with exactly `top_logprobs` alternatives per token."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def opening_chunk(self) -> dict:
        return self._envelope(self.chunk_object, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}])

    def _choice(self, text, token_ids, logprobs, finish_reason, whole: bool) -> dict:
        if whole:
            body = {"message": {"role": "assistant", "content": text}}
        else:
            body = {"delta": {"content": text} if text else {}}
        lps = self._logprobs(token_ids, logprobs) if self.num_logprobs is not None else None
        return {"index": 0, **body, "logprobs": lps, "finish_reason": finish_reason}

    def _entry(self, token_id: int, logprob: float) -> dict:
        token = self.token_text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    def _logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs]) -> dict:
        content = []
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            top = sorted(lp.items(), key=lambda kv: -kv[1])[: self.num_logprobs]
            content.append({**self._entry(token_id, lp[token_id]), "top_logprobs": [self._entry(t, v) for t, v in top]})
        return {"content": content}


class StreamText:
    """The text a stream sends, token by token. With stop strings, the last (longest stop - 1)
    characters are held back: they may begin a stop string the engine will cut. The final chunk sends
    the rest of the engine's final text, so the streamed text always equals the non-streamed one."""

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.num_sent = 0  # characters of `text` sent

    def add(self, token_ids: list[int]) -> str:
        """The new text that is safe to send."""
        for token_id in token_ids:
            self.text += self.detokenizer.step(token_id)
        end = len(self.text) - self.hold_back
        if end <= self.num_sent:
            return ""
        delta, self.num_sent = self.text[self.num_sent : end], end
        return delta

    def finish(self, final_text: str) -> str:
        """What is left to send of the request's final text."""
        return final_text[self.num_sent :]
