"""The fixed costs of a push in buckets were cut without weakening a check or a guarantee.

- the validation memo (`check_sources`) still refuses a wrong shape, a duplicate, an unknown name and a partial
  set after the same names were accepted;
- the finite check batched per dtype still names the first non-finite tensor of a mixed-dtype update;
- the RoPE table (not in checkpoints) is recomputed once a level-2 push in buckets completes, on every rank,
  and a push into intact weights leaves it as it is;
- `WeightPusher(in_flight=1)` builds the next request while the previous one is in flight, but sends them one
  at a time, in order, sends nothing after a failure, and reports the engine's time per phase; with
  `in_flight=2` two requests are in flight, never three, nothing is sent after a failure and the error is
  raised once the request still in flight answered (its bucket referenced until then).
"""

import threading

import pytest
import torch

from torpor.engine import LLM, SamplingParams
from torpor.engine.weights.loader import check_update, first_non_finite, iter_checkpoint
from torpor.rl import WeightPusher, bucket_named_tensors, weight_sync

ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=8, block_size=4)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [7, 8, 9]]


def _answers(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _rope(llm) -> torch.Tensor:
    return llm.engine.executor.driver.runner.model.model.rotary_emb.cos_sin_cache.clone()


# ---- validation ---------------------------------------------------------------------------------------
def test_checks_hold_after_the_same_names_were_accepted(tiny_model_path):
    llm = LLM(tiny_model_path, **ENGINE)
    model = llm.engine.executor.driver.runner.model
    named = list(iter_checkpoint(tiny_model_path))
    check_update(model, named, strict=True)  # every (name, shape, dtype) accepted once
    name, tensor = named[1]
    with pytest.raises(ValueError, match=name):
        check_update(model, [(name, tensor[:-1])], strict=False)  # the same name, another shape
    with pytest.raises(ValueError, match="given twice"):
        check_update(model, [(name, tensor), (name, tensor)], strict=False)
    with pytest.raises(ValueError, match="matches no parameter"):
        check_update(model, [("model.layers.9.mlp.up_proj.weight", tensor)], strict=False)
    with pytest.raises(ValueError, match="missing"):
        check_update(model, named[:-1], strict=True)
    with pytest.raises(ValueError, match="unsupported dtype"):
        check_update(model, [(name, tensor.to(torch.int32))], strict=False)
    check_update(model, named, strict=True)


def test_the_finite_check_names_the_first_bad_tensor_across_dtypes():
    a, b, c = torch.randn(4, 4), torch.randn(8).bfloat16(), torch.randn(3).half()
    assert first_non_finite([a, b, c, torch.zeros(0), torch.arange(3)]) is None
    bad_b, bad_c = b.clone(), c.clone()
    bad_b[5], bad_c[0] = float("nan"), float("-inf")
    assert first_non_finite([a, bad_b, c]) == 1
    assert first_non_finite([a, c, bad_b]) == 2
    assert first_non_finite([bad_c, a, bad_b]) == 0
    assert first_non_finite([a, bad_b, bad_c]) == 1


def test_the_finite_check_of_a_flattened_bucket_reduces_it_once_and_still_names_the_tensor():
    """The views of one bucket (16-byte aligned, mixed dtypes) are reduced per dtype as one run: a NaN in any
    of them is found and named, one in the padding between them is not a tensor's."""
    from torpor.engine.weights.payload import named_tensors_of
    from torpor.rl import bucket_named_tensors

    named = [("a", torch.randn(5, 3)), ("b", torch.randn(7).bfloat16()), ("c", torch.randn(9)),
             ("d", torch.randn(2, 3).half()), ("e", torch.randn(11))]
    bucket = next(iter(bucket_named_tensors(named, bucket_bytes=1 << 20)))
    views = [t for _, t in named_tensors_of(bucket.payload(), "flattened_bucket")]
    assert first_non_finite(views) is None
    for k in range(len(views)):
        for value in (float("nan"), float("inf"), float("-inf")):
            broken = [v.clone() if i != k else v for i, v in enumerate(views)]  # the others moved out of the run
            original = views[k].view(-1)[-1].item()
            views[k].view(-1)[-1] = value
            assert first_non_finite(views) == k and first_non_finite(broken) == k
            views[k].view(-1)[-1] = original
    padding = bucket.flattened[5 * 3 * 4 : 5 * 3 * 4 + 4]  # after "a" (60 bytes, padded to 64)
    padding.view(torch.float32)[0] = float("nan")
    assert first_non_finite(views) is None


# ---- the RoPE table -------------------------------------------------------------------------------------
def test_a_level_2_push_in_buckets_restores_the_rope_table(tiny_model_path, new_weights_path):
    llm = LLM(tiny_model_path, **ENGINE)
    table = _rope(llm)
    expected = _answers(LLM(new_weights_path, **ENGINE))
    llm.update_weights_from_tensor(list(iter_checkpoint(new_weights_path)))  # intact weights: table untouched
    assert torch.equal(_rope(llm), table)
    llm.sleep(2)
    llm.wake_up(["weights"])
    assert not _rope(llm).any()  # discarded with the weights
    buckets = list(bucket_named_tensors(iter_checkpoint(new_weights_path), bucket_bytes=200_000))
    assert len(buckets) > 1
    for bucket in buckets:
        llm.update_weights_from_tensor(bucket.payload(), load_format="flattened_bucket")
    assert torch.equal(_rope(llm), table)
    llm.wake_up()
    assert _answers(llm) == expected


@pytest.mark.slow
def test_a_tensor_parallel_level_2_push_in_buckets_restores_every_rank(tiny_model_path, new_weights_path):
    expected = _answers(LLM(new_weights_path, **ENGINE))
    llm = LLM(tiny_model_path, tensor_parallel_size=2, **ENGINE)
    try:
        llm.sleep(2)
        llm.wake_up(["weights"])
        for bucket in bucket_named_tensors(iter_checkpoint(new_weights_path), bucket_bytes=200_000):
            llm.update_weights_from_tensor(bucket.payload(), load_format="flattened_bucket")
        llm.wake_up()
        assert _answers(llm) == expected  # rank 1's table too: its heads would be wrong otherwise
    finally:
        llm.close()


# ---- the trainer's side -----------------------------------------------------------------------------------
class _Response:
    def __init__(self, status_code: int, body: dict) -> None:
        self.status_code, self._body, self.text = status_code, body, str(body)

    def json(self) -> dict:
        return self._body


class _Server:
    """Stands in for the engine's HTTP endpoint: records the requests, checks they never overlap, and can make
    one fail. Request 0 answers only once the pusher has built request 1 (the overlap)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.bodies: list[dict] = []
        self.fail_at = fail_at
        self.active = 0
        self.overlapping = False
        self.built = threading.Event()  # set when the pusher serializes its second request

    def post(self, path: str, json: dict, headers: dict) -> _Response:
        self.active += 1
        self.overlapping |= self.active > 1
        index = len(self.bodies)
        assert headers["X-Torpor-Push-Index"] == str(index)
        self.bodies.append(json)
        if index == 0:
            assert self.built.wait(30), "the next request was not built while the first was in flight"
        self.active -= 1
        if index == self.fail_at:
            return _Response(400, {"error": {"message": "refused"}})
        return _Response(200, {"seconds": 0.001, "timings": {"decode": 0.0004, "copy": 0.0005, "total": 0.001}})

    def close(self) -> None:
        pass


@pytest.fixture
def fake_serialize(monkeypatch):
    """Payloads become their tensor names (no shared memory); serializing the second one sets `built`."""
    calls = []

    def serialize(payload) -> str:
        calls.append(payload)
        if len(calls) == 2:
            server.built.set()
        return ",".join(name for name, *_ in payload["metadata"])

    server = None

    def use(s: _Server) -> list:
        nonlocal server
        server = s
        return calls

    monkeypatch.setattr(weight_sync, "serialize", serialize)
    return use


def _tensors(count: int) -> list[tuple[str, torch.Tensor]]:
    return [(f"t{i}", torch.full((4,), float(i))) for i in range(count)]


def test_requests_go_one_at_a_time_in_order_while_the_next_is_built(fake_serialize):
    server = _Server()
    fake_serialize(server)
    pusher = WeightPusher("http://engine", "token", bucket_bytes=16, in_flight=1)  # 16 bytes: a tensor a bucket
    pusher.http = server
    report = pusher.push(_tensors(5))
    assert [b["serialized_named_tensors"] for b in server.bodies] == [[f"t{i}"] for i in range(5)]
    assert [b["flush_cache"] for b in server.bodies] == [False] * 4 + [True]  # the last one flushes
    assert not server.overlapping
    assert (report.requests, report.buckets, report.tensors) == (5, 5, 5)
    assert report.engine_phases == pytest.approx({"decode": 0.002, "copy": 0.0025, "total": 0.005})


def test_nothing_is_sent_after_a_failed_request(fake_serialize):
    server = _Server(fail_at=1)
    fake_serialize(server)
    pusher = WeightPusher("http://engine", "token", bucket_bytes=16, in_flight=1)
    pusher.http = server
    with pytest.raises(RuntimeError, match=r"update_weights_from_tensor failed \(400\)"):
        pusher.push(_tensors(6))
    assert [b["serialized_named_tensors"] for b in server.bodies] == [["t0"], ["t1"]]


def test_an_in_process_push_reports_the_engines_phases(tiny_model_path, new_weights_path):
    llm = LLM(tiny_model_path, **ENGINE)
    expected = _answers(LLM(new_weights_path, **ENGINE))
    report = WeightPusher(llm, bucket_bytes=200_000).push(iter_checkpoint(new_weights_path))
    assert report.requests == report.buckets > 1
    assert {"decode", "check", "plan", "finite", "copy", "sync", "release", "total"} <= set(report.engine_phases)
    assert _answers(llm) == expected


class _DeepServer:
    """Stands in for the engine's HTTP endpoint for a pusher with 2 requests in flight: each request holds its
    answer until the next one arrived (or 0.3 s passed), so two are in flight; records what was in flight when
    each came and can make one fail."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.lock = threading.Lock()
        self.arrived: list[threading.Event] = [threading.Event() for _ in range(64)]
        self.answered: set[int] = set()
        self.in_flight_at_arrival: list[int] = []
        self.fail_at = fail_at

    def post(self, path: str, json: dict, headers: dict) -> _Response:
        index = int(headers["X-Torpor-Push-Index"])
        with self.lock:
            self.in_flight_at_arrival.append(index - len(self.answered))
            assert index - 2 in self.answered or index < 2, f"request {index} sent before request {index - 2}'s answer"
        self.arrived[index].set()
        self.arrived[index + 1].wait(0.3)
        with self.lock:
            self.answered.add(index)
        if index == self.fail_at:
            return _Response(400, {"error": {"message": "refused"}})
        return _Response(200, {"seconds": 0.001, "timings": {"copy": 0.0005, "total": 0.001, "stage": 0.0002}})

    def close(self) -> None:
        pass


def test_two_requests_in_flight_and_no_third(monkeypatch):
    monkeypatch.setattr(weight_sync, "serialize", lambda payload: ",".join(n for n, *_ in payload["metadata"]))
    server = _DeepServer()
    pusher = WeightPusher("http://engine", "token", bucket_bytes=16, in_flight=2)
    pusher.http = server
    report = pusher.push(_tensors(6))
    assert (report.requests, report.in_flight, report.staged) == (6, 2, 6)
    assert max(server.in_flight_at_arrival) == 1  # one in flight when the next came: two at once, never three
    assert report.handler_seconds == [0.001] * 6


def test_after_a_failure_in_flight_nothing_more_is_sent_and_the_error_waits_for_the_rest(monkeypatch):
    monkeypatch.setattr(weight_sync, "serialize", lambda payload: ",".join(n for n, *_ in payload["metadata"]))
    server = _DeepServer(fail_at=1)
    pusher = WeightPusher("http://engine", "token", bucket_bytes=16, in_flight=2)
    pusher.http = server
    with pytest.raises(RuntimeError, match=r"update_weights_from_tensor failed \(400\)"):
        pusher.push(_tensors(6))
    assert server.answered == {0, 1, 2}  # request 2 was in flight when 1 failed; it answered before the raise
    assert not server.arrived[3].is_set()
