"""SGLang's native inference surface: `POST /generate`, `GET /health_generate`, `GET /get_model_info`
(and `/model_info`), `GET /get_server_info` (and `/server_info`); bodies and answers as SGLang's
(sglang_protocol.py maps the request).

`/generate` answers `{"text", "output_ids", "meta_info"}`, a list of them for a batch (prompt-major, n
samples each). `meta_info`: `id` (the request id: `rid`, `{rid}_{i}` in a batch, a fresh hex id per
sample when n > 1), `finish_reason` (`{"type": "stop", "matched": stop string or token id}`,
`{"type": "length", "length": max_new_tokens}`, `{"type": "abort", "message"}`; null while streaming),
`prompt_tokens`, `completion_tokens`, `cached_tokens`, `weight_version` (the label now), `weight_versions`
(torpor's, vLLM's spans: the weights that sampled each span of the output, once finished; null before),
`e2e_latency` (once finished),
and with `return_logprob` `input_token_logprobs` / `output_token_logprobs` as `[logprob, token id,
text or null]` (the first prompt token's logprob is null) plus, with `top_logprobs_num`,
`input_top_logprobs` / `output_top_logprobs` (a list of such entries per position). Streaming sends
SSE `data: {...}` chunks as SGLang does by default: each holds the text, output ids and logprobs so far
(cumulative, not deltas), batch chunks an `index`; then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

import torpor
from torpor.engine.models.config import read_json_object
from torpor.engine.outputs import CompletionOutput, RequestOutput
from torpor.engine.sampling_params import SamplingParams
from torpor.server.auth import require_api_key
from torpor.server.errors import APIError, engine_error, json_text
from torpor.server.generation import Submitted, outputs, results, submit
from torpor.server.prompts import prompts_of
from torpor.server.protocol import check_unicode
from torpor.server.responses import weight_versions
from torpor.server.sglang_protocol import GenerateRequest, Item, normalize

if TYPE_CHECKING:
    from torpor.server.state import ServerState

router = APIRouter(dependencies=[Depends(require_api_key)])
public_router = APIRouter()  # /health_generate: public, as SGLang keeps /health* outside its API key
HEALTH_CHECK_TIMEOUT = 20.0  # SGLang's: a one-token generation that has not answered by then is unhealthy


@router.post("/generate")
@router.put("/generate", include_in_schema=False)  # SGLang takes both
async def generate(body: GenerateRequest, request: Request):
    server: ServerState = request.app.state.server
    start = time.perf_counter()
    body.check_fields()
    check_unicode(body)
    items, batch = normalize(body)
    prompt_param = "text" if body.text is not None else "input_ids"
    prompts = prompts_of(request)
    prompts.check_count(len(items), prompt_param)
    token_ids = await _token_ids(request, items, prompt_param)
    params = [_sampling_params(server, item, ids, prompt_param) for item, ids in zip(items, token_ids, strict=True)]
    submitted = await submit(request, server, token_ids, params, [item.rid for item in items], body.stream,
                             prompt_param)
    fmt = GenerateFormat(server, items, params, start, body)
    if body.stream:
        return StreamingResponse(_events(submitted, fmt, batch), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    finals = await results(request, submitted)
    answer = [entry for i, output in enumerate(finals) for entry in fmt.finished(i, output)]
    return answer if batch else answer[0]


async def _token_ids(request: Request, items: list[Item], prompt_param: str) -> list[list[int]]:
    if any(item.prompt == "" or item.prompt == [] for item in items):
        raise APIError(400, f"{prompt_param}: the prompt is empty", param=prompt_param)
    texts = [item.prompt for item in items if isinstance(item.prompt, str)]
    if not texts:
        return [list(item.prompt) for item in items]
    return await prompts_of(request).encode(texts, True, prompt_param)


def _sampling_params(server: ServerState, item: Item, token_ids: list[int], prompt_param: str) -> SamplingParams:
    """torpor's params for one prompt, the lengths checked as SGLang checks them (a 400, never a cut)."""
    max_model_len, num_input = server.engine.config.max_model_len, len(token_ids)
    if num_input >= max_model_len:
        raise APIError(400, f"The input ({num_input} tokens) is longer than the model's context length "
                            f"({max_model_len} tokens).", param=prompt_param, code="context_length_exceeded")
    requested = item.sampling.max_new_tokens
    param = f"{item.where}.max_new_tokens"
    if requested is not None and requested < 0:
        raise APIError(400, f"max_new_tokens must be at least 0, got {requested}.", param=param)
    if requested == 0 and item.sampling.min_new_tokens:
        raise APIError(400, "min_new_tokens must be in [0, max_new_tokens(0)], got "
                            f"{item.sampling.min_new_tokens}.", param=f"{item.where}.min_new_tokens")
    room = max_model_len - num_input
    if requested is not None and requested > room:
        raise APIError(400, f"Requested token count exceeds the model's maximum context length of {max_model_len} "
                            f"tokens. You requested a total of {num_input + requested} tokens: {num_input} tokens from "
                            f"the input messages and {requested} tokens for the completion. Please reduce the number "
                            "of tokens in the input messages or the completion to fit within the limit.",
                       param=param, code="context_length_exceeded")
    cap = server.config.max_tokens_cap
    if cap is not None and (requested or 0) > cap:
        raise APIError(400, f"{param}={requested} exceeds this server's limit of {cap}", param=param,
                       code="max_tokens_exceeded")
    # max_new_tokens 0 (the prompt only): one token is generated and not returned
    max_tokens = min(room, cap or room) if requested is None else max(1, requested)
    start = item.logprob_start_len
    if item.return_logprob and start > num_input:
        raise APIError(400, f"logprob_start_len ({start}) is higher than the number of input tokens ({num_input}). "
                            "Request with a lower logprob_start_len.", param="logprob_start_len")
    logprobs = item.top_logprobs_num if item.return_logprob else None
    prompt_logprobs = logprobs if item.return_logprob and 0 <= start < num_input else None
    return item.sampling.to_sampling_params(max_tokens, logprobs, prompt_logprobs, item.where)


class GenerateFormat:
    """The answers of one /generate request: an entry per sample, whole or as the stream's chunks."""

    def __init__(self, server: ServerState, items: list[Item], params: list[SamplingParams], start: float,
                 body: GenerateRequest) -> None:
        self.items, self.params, self.start = items, params, start
        self.engine, self.tokenizer = server.engine, server.engine.tokenizer
        self.with_text, self.log_metrics, self.metrics = body.return_text_in_logprobs, body.log_metrics, server.metrics
        self.return_prompt_token_ids = body.return_prompt_token_ids
        self._texts: dict[int, str | None] = {}
        self._ids: dict[tuple[int, int], str] = {}  # (prompt, sample) -> meta_info id when n > 1
        self._ended: set[tuple[int, int]] = set()  # (prompt, sample) whose final chunk went out

    def finished(self, i: int, output: RequestOutput) -> list[dict]:
        """The entries of prompt `i`'s samples, finished."""
        self.observe(i, output)
        return [self.entry(i, output, completion) for completion in output.outputs]

    def chunk(self, i: int, output: RequestOutput, completion: CompletionOutput) -> dict | None:
        """The stream chunk of a sample that gained tokens this step (or finished), else None."""
        key = (i, completion.index)
        if key in self._ended or not (completion.finished or completion.delta_token_ids):
            return None
        if completion.finished:
            self._ended.add(key)
        elif self.items[i].sampling.max_new_tokens == 0:
            return None  # the prompt only: nothing to show before the end
        return self.entry(i, output, completion)

    def observe(self, i: int, output: RequestOutput) -> None:
        if self.log_metrics:
            self.metrics.observe_request("generate", time.perf_counter() - self.start, len(output.prompt_token_ids),
                                         sum(len(c.token_ids) for c in output.outputs))

    def entry(self, i: int, output: RequestOutput, completion: CompletionOutput) -> dict:
        item, params = self.items[i], self.params[i]
        prefill_only = item.sampling.max_new_tokens == 0
        token_ids = [] if prefill_only else completion.token_ids
        meta: dict[str, Any] = {"id": self._id(i, completion.index, len(output.outputs)),
                                "finish_reason": self._finish(completion, params, prefill_only),
                                "prompt_tokens": len(output.prompt_token_ids),
                                # the label now, as SGLang reads it for every output (an update may come mid-request)
                                "weight_version": self.engine.weight_version,
                                "completion_tokens": len(token_ids), "cached_tokens": output.num_cached_tokens,
                                "weight_versions": [] if prefill_only and completion.finished else
                                weight_versions(completion)}
        if item.return_logprob:
            self._logprobs(meta, item, output, token_ids, [] if prefill_only else completion.logprobs or [])
        if completion.finished:
            meta["e2e_latency"] = time.perf_counter() - self.start
        entry = {"text": "" if prefill_only else completion.text, "output_ids": list(token_ids), "meta_info": meta}
        if self.return_prompt_token_ids:
            entry["prompt_token_ids"] = output.prompt_token_ids
        return entry

    def _id(self, i: int, sample: int, n: int) -> str:
        if n == 1:
            return self.items[i].rid
        return self._ids.setdefault((i, sample), uuid.uuid4().hex)  # SGLang gives each sample its own id

    @staticmethod
    def _finish(completion: CompletionOutput, params: SamplingParams, prefill_only: bool) -> dict | None:
        reason = completion.finish_reason
        if reason is None:
            return None
        if reason == "abort":
            return {"type": "abort", "message": "the request was aborted"}
        if prefill_only:
            return {"type": "length", "length": 0}
        if reason == "length":
            return {"type": "length", "length": params.max_tokens}
        matched = completion.stop_reason
        return {"type": "stop", "matched": completion.token_ids[-1] if matched is None else matched}

    def _logprobs(self, meta: dict, item: Item, output: RequestOutput, token_ids: list[int], logprobs: list) -> None:
        top = item.top_logprobs_num
        start = item.logprob_start_len if item.logprob_start_len >= 0 else len(output.prompt_token_ids)
        prompt = output.prompt_token_ids[start:]
        prompt_logprobs = (output.prompt_logprobs or [None] * len(output.prompt_token_ids))[start:]
        meta["input_token_logprobs"] = [[None if e is None else e[t], t, self._text(t)]
                                        for t, e in zip(prompt, prompt_logprobs, strict=True)]
        meta["output_token_logprobs"] = [[e[t], t, self._text(t)] for t, e in zip(token_ids, logprobs, strict=True)]
        if top > 0:
            meta["input_top_logprobs"] = [None if e is None else self._top(e, top) for e in prompt_logprobs]
            meta["output_top_logprobs"] = [self._top(e, top) for e in logprobs]

    def _top(self, entries: dict[int, float], k: int) -> list:
        return [[v, t, self._text(t)] for t, v in sorted(entries.items(), key=lambda kv: -kv[1])[:k]]

    def _text(self, token_id: int) -> str | None:
        if not self.with_text:
            return None
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


async def _events(submitted: Submitted, fmt: GenerateFormat, batch: bool) -> AsyncIterator[str]:
    """SGLang's stream: a chunk per sample per step that gained tokens (or finished), holding everything so
    far (a batch's with its `index`); an error as `{"error": {...}}`; then `[DONE]`."""
    try:
        async with contextlib.aclosing(outputs(submitted)) as stream:
            async for i, output in stream:
                if output.finished:
                    fmt.observe(i, output)
                for completion in output.outputs:
                    entry = fmt.chunk(i, output, completion)
                    if entry is not None:
                        if batch:
                            entry["index"] = i * len(output.outputs) + completion.index
                        yield f"data: {json_text(entry)}\n\n"
    except Exception as exc:
        yield f"data: {json_text(engine_error(exc).body())}\n\n"
    finally:
        submitted.abort()
    yield "data: [DONE]\n\n"


@public_router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """200 once a one-token generation works (SGLang's adapters wait on it before any use); 503 while the
    engine does not serve (asleep, weights discarded, stopped) or does not answer within 20 s. Concurrent
    checks share one generation."""
    server: ServerState = request.app.state.server
    if not server.engine.alive or not server.engine.serving:
        return Response(status_code=503)
    probe = getattr(request.app.state, "health_probe", None)
    if probe is None or probe.done():
        probe = request.app.state.health_probe = asyncio.ensure_future(_probe(server))
    try:
        healthy = await asyncio.wait_for(asyncio.shield(probe), HEALTH_CHECK_TIMEOUT)
    except TimeoutError:
        healthy = False
    return Response(status_code=200 if healthy else 503)


async def _probe(server: ServerState) -> bool:
    """One greedy token of the prompt [0], as SGLang's check runs it (not counted in the metrics)."""
    request_id = f"HEALTH_CHECK_{time.time()}_{uuid.uuid4().hex[:8]}"
    params = SamplingParams(max_tokens=1, temperature=0.0)
    stream = None
    try:
        stream = await server.engine.add_request(request_id, [0], params)
        output = await asyncio.wait_for(stream.result(), HEALTH_CHECK_TIMEOUT)
        return output.finished and output.outputs[0].finish_reason != "abort"
    except Exception:
        return False
    finally:
        if stream is not None:
            stream.abort()


@router.get("/get_model_info")
@router.get("/model_info", include_in_schema=False)
async def get_model_info(request: Request) -> dict:
    """SGLang's model info (`/get_model_info` is the older name of `/model_info`)."""
    server: ServerState = request.app.state.server
    config = server.engine.config
    hf = _hf_config(config.model)
    return {"model_path": config.model, "tokenizer_path": config.tokenizer or config.model, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": server.engine.weight_version,
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": hf.get("model_type"), "architectures": hf.get("architectures")}


@router.get("/get_server_info")
@router.get("/server_info", include_in_schema=False)
async def get_server_info(request: Request) -> dict:
    """The server arguments SGLang reports that apply here, under SGLang's names (secrets left out), and
    its scheduler's token limits."""
    server: ServerState = request.app.state.server
    config, settings = server.engine.config, server.config
    return {
        "model_path": config.model, "tokenizer_path": config.tokenizer or config.model,
        "served_model_name": settings.model_name, "skip_tokenizer_init": False, "is_embedding": False,
        "dtype": config.dtype, "device": config.device, "context_length": config.max_model_len,
        "tp_size": config.tensor_parallel_size, "pp_size": 1, "dp_size": 1, "page_size": config.block_size,
        "max_running_requests": config.max_num_seqs, "max_prefill_tokens": config.max_num_batched_tokens,
        "disable_radix_cache": not config.enable_prefix_caching, "random_seed": config.seed,
        "enable_memory_saver": True, "enable_weights_cpu_backup": True, "weight_version": server.engine.weight_version,
        "tool_call_parser": settings.tool_call_parser, "stream_output": False,
        "max_total_num_tokens": (config.num_kv_blocks or 0) * config.block_size,
        "max_req_input_len": config.max_model_len - 1, "status": "ready", "version": torpor.__version__,
    }


@functools.lru_cache(maxsize=8)
def _hf_config(model: str) -> dict:
    try:
        return read_json_object(Path(model) / "config.json")
    except (OSError, ValueError):
        return {}
