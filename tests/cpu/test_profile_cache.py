"""The KV-cache sizing's step memory kept between start-ups (engine/profile_cache.py): read back under the
same key, measured again under any other, never trusted when unreadable, off with kv_profile_cache=False."""

import dataclasses

import pytest
import torch

from torpor.engine import profile_cache
from torpor.engine.config import EngineConfig
from torpor.engine.models import ModelConfig
from torpor.engine.profile_cache import StepMemory


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORPOR_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture
def configs(tiny_model_path):
    return EngineConfig(model=tiny_model_path, max_model_len=128), ModelConfig.from_pretrained(tiny_model_path)


class Measure:
    """Counts how often the step really ran."""

    def __init__(self, peak: int) -> None:
        self.calls, self.peak = 0, peak

    def __call__(self) -> StepMemory:
        self.calls += 1
        return StepMemory(self.peak, 7 << 20)


def test_the_same_key_reads_the_step_back(cache_dir, configs):
    key = profile_cache.cache_key(*configs, torch.device("cpu"))
    measure = Measure(123 << 20)
    assert profile_cache.step_memory(key, measure) == (StepMemory(123 << 20, 7 << 20), False)
    assert profile_cache.step_memory(key, Measure(1)) == (StepMemory(123 << 20, 7 << 20), True)
    assert measure.calls == 1 and len(list((cache_dir / "kv-profile").glob("*.json"))) == 1


def test_anything_the_step_depends_on_makes_a_new_key(configs):
    config, model_config = configs
    key = profile_cache.cache_key(config, model_config, torch.device("cpu"))
    assert key == profile_cache.cache_key(config, model_config, torch.device("cpu"))
    others = [dataclasses.replace(config, max_num_batched_tokens=config.max_num_batched_tokens * 2),
              dataclasses.replace(config, max_num_seqs=config.max_num_seqs + 1),
              dataclasses.replace(config, max_model_len=64), dataclasses.replace(config, dtype="float16")]
    keys = {profile_cache.cache_key(c, model_config, torch.device("cpu")) for c in others}
    wider = dataclasses.replace(model_config, hidden_size=model_config.hidden_size * 2)
    keys.add(profile_cache.cache_key(config, wider, torch.device("cpu")))
    keys.add(profile_cache.cache_key(config, model_config, torch.device("cpu"), rank=1))
    assert key not in keys and len(keys) == 6


@pytest.mark.parametrize("content", ["", "{", '{"peak_bytes": -1, "outside_bytes": 0}', '{"peak_bytes": 5}',
                                     '{"peak_bytes": true, "outside_bytes": 0}', "[1, 2]"])
def test_an_unreadable_file_is_measured_over(cache_dir, configs, content):
    key = profile_cache.cache_key(*configs, torch.device("cpu"))
    (cache_dir / "kv-profile").mkdir()
    (cache_dir / "kv-profile" / f"{key}.json").write_text(content)
    measure = Measure(99)
    assert profile_cache.step_memory(key, measure) == (StepMemory(99, 7 << 20), False) and measure.calls == 1
    assert profile_cache.load(key) == StepMemory(99, 7 << 20)  # the good value replaced it


def test_switched_off_it_measures_every_time_and_keeps_nothing(cache_dir, configs):
    key = profile_cache.cache_key(*configs, torch.device("cpu"))
    measure = Measure(5)
    profile_cache.step_memory(key, measure, enabled=False)
    profile_cache.step_memory(key, measure, enabled=False)
    assert measure.calls == 2 and not (cache_dir / "kv-profile").exists()
