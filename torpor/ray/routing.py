"""The units a fleet routes: one prompt with its `n` samples, or every prompt of one `group_ids` group."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from torpor.engine.sampling_params import SamplingParams


@dataclass
class Unit:
    """Prompts that go to one replica together; `weight` is their sequences (the sum of their `n`)."""

    group: Hashable | None
    indices: list[int] = field(default_factory=list)
    prompts: list = field(default_factory=list)
    params: list = field(default_factory=list)
    weight: int = 0
    ids: list[str] | None = None  # the caller's request ids, one per prompt (None: the engine numbers them)


def prompt_list(prompts) -> list:
    """`LLM.generate`'s prompt forms as a list of prompts: a string, a dict prompt, one list of token ids, or a
    list of any of them. The replica checks each prompt as `LLM.generate` does."""
    if isinstance(prompts, str | dict):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes) or not prompts:
        raise ValueError(f"prompts must be a string, a dict prompt, a list of token ids, or a non-empty list of "
                         f"them; got {prompts!r:.80}")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [list(prompts)]
    return list(prompts)


def units_of(prompts: list, sampling_params, group_ids: list | None) -> list[Unit]:
    """Group prompts into routing units (in first-appearance order): each prompt its own, except those that
    share a `group_ids` entry."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        params = [sampling_params] * len(prompts)
    elif isinstance(sampling_params, Sequence) and len(sampling_params) == len(prompts):
        params = list(sampling_params)
    else:
        raise ValueError(f"sampling_params must be one SamplingParams or one per prompt ({len(prompts)}), got "
                         f"{sampling_params!r:.80}")
    if group_ids is None:
        group_ids = [None] * len(prompts)
    if not isinstance(group_ids, Sequence) or isinstance(group_ids, str) or len(group_ids) != len(prompts):
        raise ValueError(f"group_ids must be a list with one entry per prompt ({len(prompts)}), got {group_ids!r:.80}")
    units: list[Unit] = []
    grouped: dict[Hashable, Unit] = {}
    for i, (prompt, sp, group) in enumerate(zip(prompts, params, group_ids, strict=True)):
        if group is not None and not isinstance(group, Hashable):
            raise ValueError(f"group_ids[{i}] must be hashable (a str or int), got {type(group).__name__}")
        unit = grouped.get(group) if group is not None else None
        if unit is None:
            unit = Unit(group)
            units.append(unit)
            if group is not None:
                grouped[group] = unit
        unit.indices.append(i)
        unit.prompts.append(prompt)
        unit.params.append(sp)
        unit.weight += getattr(sp, "n", 1) if sp is not None else 1
    return units
