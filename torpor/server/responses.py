"""OpenAI response bodies: completions and chat completions, whole or as stream chunks, in vLLM's shape.

Each choice carries vLLM's `stop_reason` and `token_ids`; completions choices `prompt_logprobs` and
`prompt_token_ids` (chat: at the top level); those are null unless asked for (`return_token_ids`,
`prompt_logprobs`, or `echo` with logprobs, which computes them). Logprob tokens are the token's text,
or "token_id:N" with `return_tokens_as_token_ids`. Usage carries `prompt_tokens_details.cached_tokens`
(prompt tokens found in the prefix cache). The text, streamed deltas included, comes from the engine. Each
finished choice carries vLLM's `weight_versions`, `[{"version", "start", "end"}]`: the weights that sampled each
span of its output tokens (streamed: on its last chunk, null before).
"""

from __future__ import annotations

import time
from typing import Any

from torpor.engine.logprobs import position_logprobs
from torpor.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from torpor.engine.routed_experts import encode
from torpor.server.tool_calls import ToolCallStream, ToolParser


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int | None = None) -> dict:
    body: dict[str, Any] = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
                            "total_tokens": num_prompt_tokens + num_output_tokens}
    if num_cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return body


def weight_versions(completion: CompletionOutput) -> list[dict] | None:
    """vLLM's `weight_versions` of a choice: its spans once finished, else None."""
    spans = completion.weight_versions
    return None if spans is None else [{"version": s.version, "start": s.start, "end": s.end} for s in spans]


def _routed(routed_experts) -> dict:
    """A choice's `routed_experts` (asked for with `return_routed_experts`; format: torpor/engine/routed_experts.py)."""
    return {} if routed_experts is None else {"routed_experts": encode(routed_experts)}


class ResponseFormat:
    """The envelope and the per-choice state of one request's response (whole, or streamed)."""

    object = chunk_object = ""

    def __init__(self, tokenizer, model_name: str, request_id: str, num_logprobs: int | None, *,
                 num_prompt_logprobs: int | None = None, tokens_as_ids: bool = False, return_token_ids: bool = False,
                 continuous_usage: bool = False) -> None:
        self.tokenizer, self.model_name, self.request_id = tokenizer, model_name, request_id
        self.num_logprobs, self.num_prompt_logprobs = num_logprobs, num_prompt_logprobs
        self.tokens_as_ids, self.return_token_ids = tokens_as_ids, return_token_ids
        self.continuous_usage = continuous_usage
        self.created = int(time.time())
        self._texts: dict[int, str] = {}  # token id -> its text (logprob entries repeat tokens)
        self._started: set[int] = set()  # choices whose first chunk went out
        self._ended: set[int] = set()  # choices whose final chunk went out

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model_name,
                "choices": choices, **extra}

    def token_text(self, token_id: int) -> str:
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return self.decoded(token_id)

    def decoded(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def prompt_logprobs(self, output: RequestOutput) -> list | None:
        """vLLM's `prompt_logprobs`: per prompt token None (the first) or {id: {logprob, rank,
        decoded_token}} (the top entries plus the actual token, which is ranked when it is among them)."""
        if output.prompt_logprobs is None:
            return None
        return [None if entries is None else
                {str(token): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                 for token, lp in position_logprobs(entries, actual, self.num_prompt_logprobs, self.decoded).items()}
                for entries, actual in zip(output.prompt_logprobs, output.prompt_token_ids, strict=True)]

    @staticmethod
    def totals(outputs: list[RequestOutput]) -> dict:
        prompt = sum(len(out.prompt_token_ids) for out in outputs)
        generated = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        return usage(prompt, generated, sum(out.num_cached_tokens for out in outputs))

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict:
        return self._envelope(self.chunk_object, [], usage=self.totals(outputs))

    def opening_chunks(self, num_choices: int) -> list[dict]:
        return []

    def step_chunk(self, output: RequestOutput, completion: CompletionOutput, index: int) -> dict | None:
        """The chunk of choice `index` for what `completion` gained this step, or None (nothing new)."""
        raise NotImplementedError

    def _continuous_usage(self, output: RequestOutput, completion: CompletionOutput) -> dict:
        return {"usage": usage(len(output.prompt_token_ids), len(completion.token_ids))} if self.continuous_usage \
            else {}


class CompletionFormat(ResponseFormat):
    """`text_completion`; logprobs as {tokens, token_logprobs, top_logprobs, text_offset}. `echo_texts` (one
    per prompt): the prompt's text before the output (with its token ids and, asked for, logprobs);
    `echo_only` (max_tokens 0 with echo): the prompt alone."""

    object = chunk_object = "text_completion"

    def __init__(self, *args, echo_texts: list[str] | None = None, echo_only: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.echo_texts, self.echo_only = echo_texts, echo_only
        self._text_offsets: dict[int, int] = {}  # choice index -> offset of its next token, across chunks

    def response(self, outputs: list[RequestOutput]) -> dict:
        """The whole response of a batch of prompts (one output each): choice index = prompt index * n +
        sample index, as OpenAI and vLLM number them."""
        choices = []
        for i, out in enumerate(outputs):
            prompt_logprobs = self.prompt_logprobs(out)
            for completion in out.outputs:
                index = i * len(out.outputs) + completion.index
                text, token_ids, logprobs = self._with_echo(i, out, completion.text, completion.token_ids,
                                                            completion.logprobs)
                choices.append({**self._choice(text, token_ids, logprobs, completion, index),
                                "prompt_logprobs": prompt_logprobs,
                                "prompt_token_ids": out.prompt_token_ids if self.return_token_ids else None})
        return self._envelope(self.object, choices, usage=self.totals(outputs))

    def step_chunk(self, output: RequestOutput, completion: CompletionOutput, index: int) -> dict | None:
        first = index not in self._started
        text, token_ids, logprobs = completion.delta_text, completion.delta_token_ids, completion.delta_logprobs
        if first and self.echo_texts is not None:
            text, token_ids, logprobs = self._with_echo(index // len(output.outputs), output, text, token_ids, logprobs)
        if index in self._ended or not (text or token_ids or completion.finished):
            return None
        self._started.add(index)
        if completion.finished:
            self._ended.add(index)
        choice = {**self._choice(text, token_ids, logprobs, completion, index, delta=True),
                  "prompt_token_ids": output.prompt_token_ids if self.return_token_ids and first else None}
        return self._envelope(self.chunk_object, [choice], **self._continuous_usage(output, completion))

    def _with_echo(self, prompt_index: int, output: RequestOutput, text: str, token_ids: list[int],
                   logprobs: list[TokenLogprobs] | None) -> tuple[str, list[int], list | None]:
        """The output (or its first delta) with the prompt before it, when echoing."""
        if self.echo_texts is None:
            return text, token_ids, logprobs
        prompt_text, prompt_ids = self.echo_texts[prompt_index], output.prompt_token_ids
        prompt_logprobs = output.prompt_logprobs if self.num_logprobs is not None else None
        if self.echo_only:
            return prompt_text, prompt_ids, prompt_logprobs
        joined = None if logprobs is None else [*(prompt_logprobs or [None] * len(prompt_ids)), *logprobs]
        return prompt_text + text, [*prompt_ids, *token_ids], joined

    def _choice(self, text: str, token_ids: list[int], logprobs: list | None, completion: CompletionOutput,
                index: int, delta: bool = False) -> dict:
        shown = token_ids  # the output's own tokens (vLLM: the echoed prompt's are in prompt_token_ids)
        if self.echo_texts is not None:
            shown = completion.delta_token_ids if delta else completion.token_ids
        return {"index": index, "text": text,
                "logprobs": None if self.num_logprobs is None else self._logprobs(token_ids, logprobs, index),
                "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
                "token_ids": list(shown) if self.return_token_ids else None,
                "weight_versions": weight_versions(completion),
                **_routed(completion.delta_routed_experts if delta else completion.routed_experts)}

    def _logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs | None], index: int) -> dict:
        tokens, offsets, chosen, tops = [], [], [], []
        offset = self._text_offsets.get(index, 0)
        for token_id, entries in zip(token_ids, logprobs, strict=True):
            tokens.append(self.token_text(token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
            if entries is None:  # the first prompt token (echo): nothing precedes it
                chosen.append(None)
                tops.append(None)
                continue
            chosen.append(entries[token_id])
            # The engine gives the top-n plus the chosen token: all of them, most likely first.
            tops.append({self.token_text(t): v for t, v in sorted(entries.items(), key=lambda kv: -kv[1])})
        self._text_offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}


class ChatFormat(ResponseFormat):
    """`chat.completion` / `chat.completion.chunk`; logprobs as {content: [{token, logprob, bytes,
    top_logprobs}]}, with exactly `top_logprobs` alternatives per token. With a `tool_parser` the output
    is read for tool calls (the message's `tool_calls`, finish reason "tool_calls"; streamed as vLLM
    streams their deltas). `echo`: the text the reply starts with (chat_protocol's `echoed`)."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, *args, prompt_token_ids: list[int] | None = None, tool_parser: ToolParser | None = None,
                 echo: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompt_token_ids, self.tool_parser, self.echo = prompt_token_ids, tool_parser, echo
        self._streams: dict[int, ToolCallStream] = {}
        self._so_far: dict[int, str] = {}  # choice index -> its text so far (tool-call streams re-read it)
        self._held: dict[int, tuple[list[int], list]] = {}  # tokens of steps that sent nothing yet

    def response(self, outputs: list[RequestOutput]) -> dict:
        (out,) = outputs
        choices = []
        for completion in out.outputs:
            content, calls = self.tool_parser.extract(completion.text) if self.tool_parser else (completion.text, [])
            message: dict[str, Any] = {"role": "assistant", "content": self.echo + (content or "") if self.echo
                                       else content}
            if calls:
                message["tool_calls"] = calls
            choices.append({"index": completion.index, "message": message,
                            "logprobs": self._logprobs(completion.token_ids, completion.logprobs),
                            "finish_reason": "tool_calls" if calls else completion.finish_reason,
                            "stop_reason": completion.stop_reason,
                            "token_ids": list(completion.token_ids) if self.return_token_ids else None,
                            "weight_versions": weight_versions(completion), **_routed(completion.routed_experts)})
        return self._envelope(self.object, choices, usage=self.totals(outputs),
                              prompt_logprobs=self.prompt_logprobs(out),
                              prompt_token_ids=self.prompt_token_ids if self.return_token_ids else None)

    def opening_chunks(self, num_choices: int) -> list[dict]:
        extra: dict[str, Any] = {}
        if self.return_token_ids:
            extra["prompt_token_ids"] = self.prompt_token_ids
        if self.continuous_usage:
            extra["usage"] = usage(len(self.prompt_token_ids or ()), 0)
        chunks = [self._envelope(self.chunk_object, [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}], **extra)
                  for index in range(num_choices)]
        if self.echo:
            chunks += [self._envelope(self.chunk_object, [{"index": index, "delta": {"content": self.echo},
                                                           "logprobs": None, "finish_reason": None}])
                       for index in range(num_choices)]
        return chunks

    def step_chunk(self, output: RequestOutput, completion: CompletionOutput, index: int) -> dict | None:
        if index in self._ended:
            return None
        held_ids, held_logprobs = self._held.pop(index, ([], []))
        token_ids = held_ids + completion.delta_token_ids
        logprobs = None if completion.logprobs is None else held_logprobs + completion.delta_logprobs
        delta: dict[str, Any] = {}
        finish = completion.finish_reason
        if self.tool_parser is None:
            if completion.delta_text:
                delta["content"] = completion.delta_text
        else:
            stream = self._streams.get(index) or self._streams.setdefault(index, self.tool_parser.stream())
            self._so_far[index] = text = self._so_far.get(index, "") + completion.delta_text
            content, calls = stream.feed(text, final=finish is not None)
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = calls
            if finish is not None and stream.called:
                finish = "tool_calls"
        if not delta and finish is None and (self.tool_parser is not None or not token_ids):
            if token_ids:  # the tool-call parser has nothing to say yet: these tokens go with its next chunk
                self._held[index] = (token_ids, logprobs or [])
            return None
        if finish is not None:
            self._ended.add(index)
        choice = {"index": index, "delta": delta, "logprobs": self._logprobs(token_ids, logprobs),
                  "finish_reason": finish, "stop_reason": completion.stop_reason,
                  "weight_versions": weight_versions(completion), **_routed(completion.delta_routed_experts)}
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return self._envelope(self.chunk_object, [choice], **self._continuous_usage(output, completion))

    def _entry(self, token_id: int, logprob: float) -> dict:
        # `bytes`: the token's raw bytes (a byte-fallback or partial UTF-8 token is not U+FFFD's UTF-8)
        return {"token": self.token_text(token_id), "logprob": logprob,
                "bytes": list(self.tokenizer.token_bytes(token_id))}

    def _logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs] | None) -> dict | None:
        if self.num_logprobs is None or logprobs is None:
            return None
        content = []
        for token_id, entries in zip(token_ids, logprobs, strict=True):
            top = sorted(entries.items(), key=lambda kv: -kv[1])[: self.num_logprobs]
            content.append({**self._entry(token_id, entries[token_id]),
                            "top_logprobs": [self._entry(t, v) for t, v in top]})
        return {"content": content}
