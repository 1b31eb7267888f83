"""The bit-exact sleep/wake harness and the soak, shared by the tests and `torpor bench sleep`.

A fixed batch of requests (mixed lengths, greedy and seeded sampling, output and prompt logprobs,
every fourth one sharing a prefix with the others of its kind and sampling n = 2 completions, so the
prefix cache and forked samples are exercised) runs once awake, from an empty prefix cache; after
every kind of sleep and wake the same batch runs again and must match the first round exactly:
token ids, text, every output logprob and every prompt logprob (and a MoE model's routed experts, where
the requests ask for them).
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from torpor.engine.outputs import RequestOutput
from torpor.engine.sampling_params import SamplingParams
from torpor.engine.weights.loader import iter_checkpoint
from torpor.memory import process_rss_bytes

Request = tuple[list[int], SamplingParams]


def fixed_requests(num: int, vocab_size: int, seed: int = 0, max_prompt: int = 48,
                   max_tokens: int = 16) -> list[Request]:
    """`num` requests of mixed prompt lengths; even ones greedy, odd ones seeded sampling. Every fourth
    prompt starts with the same head (up to 3/4 of max_prompt tokens), asks for no prompt logprobs (so it
    may use the prefix cache) and samples two completions."""
    rng = random.Random(seed)
    head = [rng.randrange(vocab_size) for _ in range(max(1, max_prompt * 3 // 4))]
    requests = []
    for i in range(num):
        shares_prefix = i % 4 == 3
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(2, max_prompt))]
        if shares_prefix:  # no longer than the other prompts can be
            prompt = (head + prompt)[: max(len(head) + 1, len(prompt))]
        common = dict(max_tokens=rng.randint(1, max_tokens), logprobs=2, ignore_eos=True,
                      prompt_logprobs=None if shares_prefix else 2, n=2 if shares_prefix else 1)
        if i % 2:
            params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=10_000 + i, **common)
        else:
            params = SamplingParams(temperature=0.0, **common)
        requests.append((prompt, params))
    return requests


def run_round(llm, requests: list[Request]) -> list[RequestOutput]:
    """One round of `requests` (the prefix cache as it is: empty after any sleep that discards the KV)."""
    return llm.generate([p for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)


def differences(reference: list[RequestOutput], outputs: list[RequestOutput]) -> list[str]:
    """Every way `outputs` differ from `reference` (empty when bit-identical)."""
    found = []
    for i, (ref, out) in enumerate(zip(reference, outputs, strict=True)):
        if len(ref.outputs) != len(out.outputs):
            found.append(f"request {i}: {len(out.outputs)} completions, not {len(ref.outputs)}")
        for a, b in zip(ref.outputs, out.outputs, strict=False):
            for field, x, y in (("token_ids", a.token_ids, b.token_ids), ("text", a.text, b.text),
                                ("logprobs", a.logprobs, b.logprobs)):
                if x != y:
                    found.append(f"request {i} sample {a.index}: {field} differ")
            if (a.routed_experts is None) != (b.routed_experts is None) or (
                    a.routed_experts is not None and not np.array_equal(a.routed_experts, b.routed_experts)):
                found.append(f"request {i} sample {a.index}: routed_experts differ")
        if ref.prompt_logprobs != out.prompt_logprobs:
            found.append(f"request {i}: prompt_logprobs differ")
    return found


def reference_round(llm, requests: list[Request]) -> list[RequestOutput]:
    """The first round, from an empty prefix cache: the state every KV-discarding sleep leaves."""
    reset = getattr(llm, "reset_prefix_cache", None)
    if reset is not None:
        reset()
    return run_round(llm, requests)


@dataclass
class Scenario:
    name: str
    run: Callable  # (llm) -> None: the sleep/wake sequence before the round
    sleep_s: float = 0.0
    wake_s: float = 0.0
    asleep_bytes: int = 0
    mismatches: int = -1


def _cycle(level: int, wakes: list[list[str] | None], weights: str | None = None) -> Callable:
    """sleep(level), then the wakes in order; `weights` ('reload' | 'update') after the first."""

    def run(llm) -> tuple[float, float, int]:
        start = time.perf_counter()
        llm.sleep(level)
        slept = time.perf_counter() - start
        asleep = llm.memory_usage()["device_used_bytes"]
        start = time.perf_counter()
        for i, tags in enumerate(wakes):
            llm.wake_up(tags)
            if i == 0 and weights == "reload":
                llm.reload_weights()
            elif i == 0 and weights == "update":
                llm.update_weights(list(trainer_tensors(llm.config.model)))  # as a trainer pushing weights
        return slept, time.perf_counter() - start, asleep

    return run


@functools.lru_cache(maxsize=1)
def trainer_tensors(path: str) -> tuple[tuple[str, torch.Tensor], ...]:
    """The checkpoint's tensors, read once and kept in host memory: what a trainer holds and pushes every
    cycle (reading the files again each cycle would measure the disk, not the push)."""
    return tuple(iter_checkpoint(path))


def scenarios() -> list[Scenario]:
    return [
        Scenario("level 1, full wake", _cycle(1, [None])),
        Scenario("level 1, wake weights then kv_cache", _cycle(1, [["weights"], ["kv_cache"]])),
        Scenario("level 2 + reload_weights", _cycle(2, [["weights"], ["kv_cache"]], "reload")),
        Scenario("level 2 + update_weights", _cycle(2, [["weights"], ["kv_cache"]], "update")),
        Scenario("level 1, full wake (again)", _cycle(1, [None])),
        Scenario("level 2 + reload, full wake", _cycle(2, [None], "reload")),
    ]


def level3_scenarios() -> list[Scenario]:
    """The paths of sleep levels 3 and 4 (the CUDA context released too; CUDA only)."""
    return [
        Scenario("level 3, full wake", _cycle(3, [None])),
        Scenario("level 3, wake weights then kv_cache", _cycle(3, [["weights"], ["kv_cache"]])),
        Scenario("level 3 + reload_weights", _cycle(3, [["weights"], ["kv_cache"]], "reload")),
        Scenario("level 4 + update_weights", _cycle(4, [["weights"], ["kv_cache"]], "update")),
    ]


def level3_soak_scenarios() -> list[Scenario]:
    """Level 3 alternating with levels 1 and 2, selective wakes among them (one reload per period: a
    reload of an 8B checkpoint costs seconds)."""
    return [
        Scenario("level 3, full wake", _cycle(3, [None])),
        Scenario("level 1, full wake", _cycle(1, [None])),
        Scenario("level 3, wake weights then kv_cache", _cycle(3, [["weights"], ["kv_cache"]])),
        Scenario("level 2 + reload_weights", _cycle(2, [["weights"], ["kv_cache"]], "reload")),
        Scenario("level 3, full wake (again)", _cycle(3, [None])),
        Scenario("level 1, wake weights then kv_cache", _cycle(1, [["weights"], ["kv_cache"]])),
    ]


def run_harness(llm, requests: list[Request], log: Callable[[str], None] = print,
                cases: list[Scenario] | None = None) -> list[Scenario]:
    """The first awake round, then every scenario (default: `scenarios()`) followed by a round compared
    with it."""
    reference = reference_round(llm, requests)
    results = []
    for scenario in cases if cases is not None else scenarios():
        scenario.sleep_s, scenario.wake_s, scenario.asleep_bytes = scenario.run(llm)
        scenario.mismatches = len(differences(reference, run_round(llm, requests)))
        log(f"{scenario.name}: {len(requests) - scenario.mismatches}/{len(requests)} bit-identical "
            f"(sleep {scenario.sleep_s * 1e3:.3g} ms, wake {scenario.wake_s * 1e3:.3g} ms, "
            f"asleep {scenario.asleep_bytes / 2**20:.0f} MiB)")
        results.append(scenario)
    return results


@dataclass
class SoakResult:
    cycles: int
    exact_cycles: int
    device_bytes: list[int]  # after each wake
    host_rss_bytes: list[int]  # after each wake
    period: int = 1  # the cycles repeat this many scenarios

    def drift(self, values: list[int]) -> float:
        """MiB per cycle: the slope of each scenario's own readings (every `period`-th cycle), the
        largest in magnitude. Readings of different scenarios differ by design (a level-2 sleep holds
        no host copy of the weights), so one slope over all of them measures the pattern, not a leak."""
        slopes = [self.slope(values[phase :: self.period]) for phase in range(self.period)]
        return max(slopes, key=abs, default=0.0)

    @staticmethod
    def slope(values: list[int]) -> float:
        """Least-squares slope per cycle, in MiB."""
        n = len(values)
        if n < 2:
            return 0.0
        mean_x, mean_y = (n - 1) / 2, sum(values) / n
        num = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values))
        den = sum((x - mean_x) ** 2 for x in range(n))
        return num / den / 2**20


def soak(llm, requests: list[Request], cycles: int, log: Callable[[str], None] | None = None,
         cases: list[Scenario] | None = None) -> SoakResult:
    """`cycles` sleep/wake cycles alternating levels and selective wakes (default: `scenarios()`), each
    followed by a round that must equal the first; device memory and host RSS recorded after every wake."""
    reference = reference_round(llm, requests)
    patterns = cases if cases is not None else scenarios()
    result = SoakResult(cycles, 0, [], [], period=len(patterns))
    for cycle in range(cycles):
        patterns[cycle % len(patterns)].run(llm)
        exact = not differences(reference, run_round(llm, requests))
        result.exact_cycles += exact
        result.device_bytes.append(llm.memory_usage()["device_used_bytes"])
        result.host_rss_bytes.append(process_rss_bytes())
        if log is not None and (cycle + 1) % max(1, cycles // 10) == 0:
            device, rss = result.device_bytes[-1] / 2**20, result.host_rss_bytes[-1] / 2**20
            log(f"cycle {cycle + 1}/{cycles}: exact so far {result.exact_cycles}/{cycle + 1}, "
                f"device {device:.0f} MiB, host RSS {rss:.0f} MiB")
    return result
