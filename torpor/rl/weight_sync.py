"""Push a trainer's weights into a torpor engine.

`WeightPusher` (same device): the model's `named_parameters()` (Hugging Face names) go into flattened
buckets of `bucket_bytes` (default 512 MiB: a handful of CUDA IPC handles for an 8B model, not ~400), each
serialized with `torch.multiprocessing`'s pickler (CUDA tensors as IPC handles; CPU tensors as
shared-memory files, the `file_system` sharing strategy) and sent to `POST /update_weights_from_tensor`
or to an in-process `LLM`. Each bucket stays referenced until the engine answered, i.e. has copied it.
Over HTTP up to `in_flight` requests (default 2) are in flight while the next is built (flattened,
synchronized, pickled); each carries torpor's push headers (`X-Torpor-Push-Id`, `X-Torpor-Push-Index`), so a
torpor server applies them in order and none after the first that failed (`torpor.server.weight_pipeline`).
`in_flight=1` sends each request after the previous answer (for servers without those headers).

`DistributedPusher` (another device or node): hosts a process group (trainer = rank 0), the engine joins
through `POST /init_weights_update_group`; each push broadcasts every tensor in order while
`POST /update_weights_from_distributed` receives them.
"""

from __future__ import annotations

import base64
import io
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler

import torch

from torpor.engine import phase_times
from torpor.engine.phase_times import phase
from torpor.engine.weights.shm import settle_references
from torpor.engine.weights.transport import broadcast, destroy_group_handle, open_update_group
from torpor.rl.bucket_ring import BucketRing

DEFAULT_BUCKET_BYTES = 512 << 20
# Requests a push keeps in flight over HTTP (1: each sent after the previous answer). 2, not 3: a third was faster
# on some H200 machines and slower on others (docs/benchmarks.md), for one more bucket of trainer memory.
DEFAULT_IN_FLIGHT = 2


@dataclass
class Position:
    """A push's id and the index of its next request, as torpor's headers (`torpor.server.weight_pipeline`)."""

    push_id: str
    index: int = 0
    keep: int = 0  # buffers the push cycles through (`BucketRing`): the engine keeps that many mappings open

    def next(self, last: bool) -> dict[str, str]:
        headers = {"X-Torpor-Push-Id": self.push_id, "X-Torpor-Push-Index": str(self.index)}
        if self.keep:
            headers["X-Torpor-Push-Keep"] = str(min(self.keep, 999))  # the engine keeps 16 at most
        if last:  # the push commits with its last request: the engine serves none of it before
            headers["X-Torpor-Push-Last"] = "1"
        self.index += 1
        return headers


@dataclass
class Bucket:
    """Tensors of one push, back to back: `flattened` is 1-D uint8 (on the tensors' device); metadata holds
    (name, shape, dtype, start byte, end byte) per tensor."""

    flattened: torch.Tensor
    metadata: list[tuple[str, list[int], torch.dtype, int, int]]

    @property
    def nbytes(self) -> int:
        return self.flattened.numel()

    def payload(self) -> dict:
        """SGLang's flattened-bucket payload."""
        return {"flattened_tensor": self.flattened, "metadata": self.metadata}


@dataclass
class PushReport:
    """One push: `seconds` in all (bucketing, serializing, requests); `engine_seconds` of them the engine
    spent loading (the servers' "seconds", or the in-process calls): the rest is the trainer's side and HTTP.
    `engine_phases`: the engine's seconds per phase summed over the requests (decode, check, plan, finite,
    copy, sync, release, ..., total; see `torpor.engine.phase_times`), when the engine reports them."""

    seconds: float
    bytes: int
    buckets: int
    tensors: int
    engine_seconds: float = 0.0
    requests: int = 0
    engine_phases: dict[str, float] = field(default_factory=dict)
    in_flight: int = 1
    handler_seconds: list[float] = field(default_factory=list)  # each request's, in order
    staged: int = 0  # requests the engine opened and checked off its engine thread (they found another in flight)
    # This process's seconds per part, summed over the push: "bucket" (flattening), "sync" (each bucket complete
    # on its device), "serialize" (pickle and base64), "wait" (for answers, with `in_flight` requests out).
    trainer_phases: dict[str, float] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def __str__(self) -> str:
        return (f"{self.tensors} tensors, {self.bytes / 2**30:.3f} GiB in {self.buckets} bucket(s), "
                f"{self.seconds:.4f} s ({self.engine_seconds:.4f} s in the engine), {self.gbps:.2f} GB/s")


def bucket_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]],
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES, ring: BucketRing | None = None) -> Iterator[Bucket]:
    """Group tensors, in order, into buckets of at most `bucket_bytes` (a larger tensor gets its own), each
    flattened into memory of its own, or into `ring`'s buffers in turn (then a bucket's memory is reused
    `ring.slots` buckets later: the caller must be done with it by then)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if pending and size + nbytes > bucket_bytes:
            yield _flatten(pending, ring)
            pending, size = [], 0
        pending.append((name, tensor.detach()))
        size += nbytes
    if pending:
        yield _flatten(pending, ring)


ALIGN = 16  # every tensor starts 16-byte aligned in its bucket (a dtype view needs an aligned offset)


def _flatten(named: list[tuple[str, torch.Tensor]], ring: BucketRing | None = None) -> Bucket:
    metadata, parts, offset = [], [], 0
    for name, tensor in named:
        data = tensor.contiguous().view(-1).view(torch.uint8)  # the tensor's bytes (any dtype)
        metadata.append((name, list(tensor.shape), tensor.dtype, offset, offset + data.numel()))
        parts.append(data)
        offset += data.numel()
        padding = -offset % ALIGN
        if padding:
            parts.append(torch.zeros(padding, dtype=torch.uint8, device=data.device))
            offset += padding
    if ring is None:
        return Bucket(torch.cat(parts), metadata)
    return Bucket(torch.cat(parts, out=ring.take(parts[0].device, offset)), metadata)


def serialize(obj) -> str:
    """base64 of a ForkingPickler pickle: tensors travel by reference (CUDA IPC / shared-memory file)."""
    if _has_cpu_tensor(obj):
        torch.multiprocessing.set_sharing_strategy("file_system")  # a file an unrelated process can open
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode()


def _has_cpu_tensor(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.device.type == "cpu"
    if isinstance(obj, dict):
        return any(_has_cpu_tensor(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_has_cpu_tensor(v) for v in obj)
    return False


class WeightPusher:
    """Pushes weights into an engine on the same device: `target` is a server URL (then `admin_token`) or
    an in-process `LLM`. `tp_size`: the engine's tensor-parallel size (one payload per rank)."""

    def __init__(self, target, admin_token: str | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 tp_size: int = 1, timeout: float = 600.0, buckets_per_request: int = 1,
                 in_flight: int = DEFAULT_IN_FLIGHT) -> None:
        if buckets_per_request < 1:
            raise ValueError(f"buckets_per_request must be >= 1, got {buckets_per_request}")
        if in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, got {in_flight}")
        self.target, self.bucket_bytes, self.tp_size = target, bucket_bytes, tp_size
        self.buckets_per_request, self.in_flight = buckets_per_request, in_flight
        self.http = None
        if isinstance(target, str):
            import httpx

            headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
            self.http = httpx.Client(base_url=target, headers=headers, timeout=timeout)

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], flush_cache: bool = True) -> PushReport:
        """Every tensor, in buckets of `bucket_bytes` (`push_buckets`). Over HTTP the buckets are flattened into
        the buffers of a `BucketRing`, one per request the push holds at once, reused in turn (each shared with
        the engine once; the engine keeps its mappings until the push's last request), given back at the end."""
        if self.http is None:
            return self.push_buckets(bucket_named_tensors(named_tensors, self.bucket_bytes), flush_cache)
        ring = BucketRing((self.in_flight + 2) * self.buckets_per_request, self.bucket_bytes)
        try:
            return self.push_buckets(bucket_named_tensors(named_tensors, self.bucket_bytes, ring), flush_cache,
                                     keep=ring.slots)
        finally:
            ring.close()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                # A buffer grown mid-push went while the engine still held it: torch parks such blocks until
                # their IPC counters drop (they have, by the last answer) and a collect frees them.
                torch.cuda.ipc_collect()

    def push_buckets(self, buckets: Iterable[Bucket], flush_cache: bool = True, keep: int = 0) -> PushReport:
        """Every bucket, `buckets_per_request` buckets per request (SGLang's form: 1; more: fewer round trips,
        more trainer memory held at once); the prefix cache is flushed after the last request. Each bucket is
        complete on the trainer's device before it is sent (the engine must read finished values) and stays
        referenced until its answer came. Over HTTP up to `in_flight` requests are in flight while the next is
        built (so `in_flight` + 2 requests' buckets are held at once: those in flight, the next, and the one
        after it, built to know whether the next is the last); each carries torpor's push headers, so the
        engine applies them in order and none after the first that failed. Answers are awaited in order and
        the first failure is raised once every request in flight has answered. `keep`: the buckets cycle through
        that many buffers (`BucketRing`, as `push` makes them), so the engine may keep that many of its mappings
        of the trainer's memory open until the last request (0: it opens and releases each request's)."""
        start = time.perf_counter()
        depth = self.in_flight if self.http is not None else 1
        report = PushReport(0.0, 0, 0, 0, in_flight=depth)
        position = Position(uuid.uuid4().hex, keep=keep)
        pending: deque[tuple[Future, list[Bucket]]] = deque()  # answers to come, with the buckets they read
        with phase_times.collect() as timed, ThreadPoolExecutor(depth, thread_name_prefix="torpor-push") as sender:
            unsent: list[Bucket] = []  # pickled, not sent yet
            try:
                for group, last in self._requests(buckets):
                    unsent = group
                    with phase("serialize"):
                        request = self._prepare(group, flush_cache=flush_cache and last)
                    with phase("wait"):
                        while len(pending) >= depth:
                            self._finish(*pending.popleft(), report)
                    pending.append((self._send(sender, request, position.next(last)), group))
                    unsent = []
                with phase("wait"):
                    while pending:
                        self._finish(*pending.popleft(), report)
            finally:
                wait([answer for answer, _ in pending])  # after a failure: the engine may still read those
                for group in [unsent, *(group for _, group in pending)]:
                    self._settle(group)
        report.trainer_phases = {name: seconds for name, seconds in timed.items() if name != "total"}
        report.seconds = time.perf_counter() - start
        return report

    def _send(self, sender: ThreadPoolExecutor, request: dict, headers: dict[str, str]) -> Future:
        if self.http is None:  # in process: the call itself, now
            return _done_future(self._post(request, headers))
        return sender.submit(self._post, request, headers)

    def _requests(self, buckets: Iterable[Bucket]) -> Iterator[tuple[list[Bucket], bool]]:
        """(buckets of one request, whether it is the last), each bucket complete on its device."""
        pending: list[Bucket] = []
        buckets = iter(buckets)
        while True:
            with phase("bucket"):  # the flattening, when `buckets` makes them as they come
                bucket = next(buckets, None)
            if bucket is None:
                break
            if bucket.flattened.is_cuda:
                with phase("sync"):
                    torch.cuda.current_stream(bucket.flattened.device).synchronize()
            if len(pending) == self.buckets_per_request:
                yield pending, False
                pending = []
            pending.append(bucket)  # held back: the last request carries flush_cache
        if pending:
            yield pending, True

    def _prepare(self, buckets: list[Bucket], flush_cache: bool) -> dict:
        """One request: for HTTP its JSON body (one pickle per rank: each is opened once, as it carries one
        reference to the trainer's memory); in process the payload itself (no pickling needed)."""
        payload = buckets[0].payload() if len(buckets) == 1 else [b.payload() for b in buckets]
        if self.http is None:
            return {"payload": payload, "flush_cache": flush_cache}
        return {"serialized_named_tensors": [serialize(payload) for _ in range(self.tp_size)],
                "load_format": "flattened_bucket", "flush_cache": flush_cache}

    def _post(self, request: dict, headers: dict[str, str]) -> dict:
        """Send one request; returns the engine's answer ({"seconds", "timings"}) once it copied the buckets."""
        if self.http is None:  # an in-process LLM
            start = time.perf_counter()
            with phase_times.collect() as timings:
                self.target.update_weights_from_tensor(request["payload"], load_format="flattened_bucket",
                                                       flush_cache=request["flush_cache"])
            return {"seconds": time.perf_counter() - start, "timings": timings}
        response = self.http.post("/update_weights_from_tensor", json=request, headers=headers)
        if response.status_code != 200:
            raise RuntimeError(f"update_weights_from_tensor failed ({response.status_code}): {response.text}")
        return response.json()

    def _finish(self, answer: Future, buckets: list[Bucket], report: PushReport) -> None:
        """Wait for one request's answer (its exception, if it failed) and count it."""
        try:
            result = answer.result()
        finally:
            self._settle(buckets)
        report.engine_seconds += float(result.get("seconds") or 0.0)
        timings = result.get("timings") or {}
        for name, seconds in timings.items():
            report.engine_phases[name] = report.engine_phases.get(name, 0.0) + float(seconds)
        report.staged += "stage" in timings
        report.requests += 1
        report.handler_seconds.append(float(result.get("seconds") or 0.0))
        report.bytes += sum(b.nbytes for b in buckets)
        report.buckets += len(buckets)
        report.tensors += sum(len(b.metadata) for b in buckets)

    def _settle(self, buckets: list[Bucket]) -> None:
        """After a request's answer (or once it will never be sent): the shared-memory references its pickles added
        for the engine and the engine did not take (it refused the request before opening it) go, so each bucket's
        file goes with the bucket (`shm.settle_references`)."""
        if self.http is None:
            return
        for bucket in buckets:
            if bucket.flattened.device.type == "cpu":
                settle_references(bucket.flattened.untyped_storage())

    def close(self) -> None:
        if self.http is not None:
            self.http.close()


class DistributedPusher:
    """The trainer's end of a weights update group, formed as SGLang's trainers form it (torch's `tcp://`
    rendezvous hosted at `master_address:master_port`, torch's key naming): rank 0 of 1 + `engine_ranks`,
    broadcasting from `device`. `url` is the engine server (admin token)."""

    def __init__(self, url: str, admin_token: str | None, master_address: str, master_port: int,
                 device: str | torch.device = "cpu", engine_ranks: int = 1, group_name: str = "weight_update_group",
                 backend: str | None = None, timeout: float = 120.0) -> None:
        import httpx


        self.device, self.group_name = torch.device(device), group_name
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.http = httpx.Client(base_url=url, headers=headers, timeout=timeout + 60)
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": 1,
                "world_size": 1 + engine_ranks, "group_name": group_name, "backend": backend, "timeout": timeout}
        with ThreadPoolExecutor(1) as pool:  # the engine joins while this process hosts the group
            joined = pool.submit(self.http.post, "/init_weights_update_group", json=body)
            try:
                self.group = open_update_group(master_address, master_port, 0, 1 + engine_ranks, group_name,
                                               backend, self.device, timeout, give_up=lambda: _refusal(joined))
            except BaseException as e:
                wait([joined])  # the engine's answer says why better than the wait that ended here
                reason = _refusal(joined)
                if reason:
                    raise RuntimeError(f"init_weights_update_group failed: {reason}") from e
                raise
        reason = _refusal(joined)
        if reason:
            destroy_group_handle(self.group)
            raise RuntimeError(f"init_weights_update_group failed: {reason}")

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], flush_cache: bool = True) -> PushReport:
        """Broadcast every tensor, in order, while the engine receives them (one request for all)."""

        named = [(n, t.detach().contiguous()) for n, t in named_tensors]
        body = {"names": [n for n, _ in named], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
                "shapes": [list(t.shape) for _, t in named], "group_name": self.group_name,
                "flush_cache": flush_cache}
        start = time.perf_counter()
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(self.http.post, "/update_weights_from_distributed", json=body)
            for _, tensor in named:
                broadcast(self.group, tensor.to(self.device))
            response = answer.result()
        if response.status_code != 200:
            raise RuntimeError(f"update_weights_from_distributed failed ({response.status_code}): {response.text}")
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        return PushReport(time.perf_counter() - start, nbytes, 1, len(named))

    def close(self) -> None:
        """Destroy the group on both ends."""

        try:
            self.http.post("/destroy_weights_update_group", json={"group_name": self.group_name})
        finally:
            destroy_group_handle(self.group)
            self.http.close()



def _done_future(result) -> Future:
    future: Future = Future()
    future.set_result(result)
    return future


def _refusal(answer) -> str | None:
    """Why the engine refused a request still in flight (a Future of its response), or None (no answer yet, or OK)."""
    if not answer.done():
        return None
    if answer.exception() is not None:
        return f"the request failed: {answer.exception()!r}"
    response = answer.result()
    return None if response.status_code == 200 else f"the engine answered {response.status_code}: {response.text}"
