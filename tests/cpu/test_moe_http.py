"""A MoE model over HTTP (uvicorn in a thread, tiny-moe fp32 on CPU): `return_routed_experts` on /v1/completions
and /v1/chat/completions (whole and streamed) decodes to what `LLM.generate` returns; SGLang's
/update_weights_from_tensor with per-expert names, refused before any byte is written when one is wrong."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from server_thread import ServerThread, error_of

from torpor.engine import LLM, SamplingParams
from torpor.engine.routed_experts import decode
from torpor.engine.weights.loader import iter_checkpoint
from torpor.rl import serialize
from torpor.server import ServerConfig, build_app
from torpor.synthetic import make_model

ENGINE = dict(device="cpu", dtype="float32", max_model_len=96, max_num_seqs=8)
ADMIN = "admin-secret"
PROMPT = [5, 17, 300, 2, 44, 9]


@pytest.fixture(scope="module")
def reference(tiny_moe_path):
    return LLM(tiny_moe_path, **ENGINE)


@pytest.fixture(scope="module")
def admin(tiny_moe_path):
    llm = LLM(tiny_moe_path, **ENGINE)
    app = build_app(llm.engine, ServerConfig("tiny-moe", admin_token=ADMIN, max_body_bytes=4 << 20))
    with ServerThread(app) as url:
        yield httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {ADMIN}"})


def expected_routed(reference, prompt: list[int], max_tokens: int) -> np.ndarray:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, return_routed_experts=True)
    return reference.generate([prompt], params)[0].outputs[0].routed_experts


def test_completions_return_routed_experts(admin, reference):
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_routed_experts": True}
    choice = admin.post("/v1/completions", json=body).json()["choices"][0]
    routed = choice["routed_experts"]
    assert set(routed) == {"data", "dtype", "shape"} and routed["dtype"] == "int16" and routed["shape"] == [5, 2, 2]
    assert np.array_equal(decode(routed), expected_routed(reference, PROMPT, 5))
    plain = admin.post("/v1/completions", json={**body, "return_routed_experts": False}).json()["choices"][0]
    assert "routed_experts" not in plain


def test_streamed_chunks_carry_the_rows_of_their_tokens(admin, reference):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_routed_experts": True,
            "stream": True}
    chunks = []
    with admin.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    rows = [decode(c["choices"][0]["routed_experts"]) for c in chunks if "routed_experts" in c["choices"][0]]
    assert np.array_equal(np.concatenate(rows), expected_routed(reference, PROMPT, 6))


def test_chat_completions_return_routed_experts(admin, reference):
    body = {"messages": [{"role": "user", "content": "Why is the sky blue?"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "return_routed_experts": True}
    choice = admin.post("/v1/chat/completions", json=body).json()["choices"][0]
    prompt = reference.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
    assert np.array_equal(decode(choice["routed_experts"]), expected_routed(reference, prompt, 4))


def test_a_bad_flag_is_a_400(admin):
    error = error_of(admin.post("/v1/completions", json={"prompt": PROMPT, "return_routed_experts": "yes"}), 400)
    assert "return_routed_experts" in error["message"]


def test_sglang_push_with_per_expert_names(admin, tiny_moe_path, tmp_path):
    new = str(make_model("tiny-moe", tmp_path / "seed2", seed=2, dtype="float32", progress=False))
    greedy = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    def answer() -> list[int]:
        body = {**greedy, "return_token_ids": True}
        return admin.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]

    def push(named) -> httpx.Response:
        return admin.post("/update_weights_from_tensor", json={"serialized_named_tensors": [serialize(named)],
                                                                "flush_cache": True})

    before = answer()
    named = list(iter_checkpoint(new))
    index = next(i for i, (n, _) in enumerate(named) if n == "model.layers.2.mlp.experts.4.up_proj.weight")
    wrong = [*named[:index], (named[index][0], named[index][1][:-1]), *named[index + 1:]]
    error = error_of(push(wrong), 400)
    assert "model.layers.2.mlp.experts.4.up_proj.weight" in error["message"] and "shape" in error["message"]
    assert answer() == before  # nothing of the push was written
    assert push(named).status_code == 200
    expected = LLM(new, **ENGINE).generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert answer() == expected[0].outputs[0].token_ids != before
    assert push(list(iter_checkpoint(tiny_moe_path))).status_code == 200
    assert answer() == before
