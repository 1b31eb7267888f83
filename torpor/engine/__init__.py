"""torpor.engine: a compact paged-KV inference engine (Llama 3, Qwen2/2.5, Qwen3).

    from torpor.engine import LLM, SamplingParams
    llm = LLM()                                   # the embedded tiny model; LLM("path/to/checkpoint")
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
    print(outputs[0].outputs[0].text)

Names are imported lazily: `import torpor.engine` does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

_EXPORTS = {  # name -> module
    "LLM": "torpor.engine.llm",
    "LLMEngine": "torpor.engine.llm_engine",
    "EngineState": "torpor.engine.llm_engine",
    "RequestError": "torpor.engine.llm_engine",
    "EngineConfig": "torpor.engine.config",
    "SamplingParams": "torpor.engine.sampling_params",
    "RequestOutput": "torpor.engine.outputs",
    "CompletionOutput": "torpor.engine.outputs",
    "Logprob": "torpor.engine.logprobs",
}
__all__ = ["LLM", "CompletionOutput", "EngineConfig", "EngineState", "LLMEngine", "Logprob", "RequestError",
           "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from torpor.engine.config import EngineConfig
    from torpor.engine.llm import LLM
    from torpor.engine.llm_engine import EngineState, LLMEngine, RequestError
    from torpor.engine.logprobs import Logprob
    from torpor.engine.outputs import CompletionOutput, RequestOutput
    from torpor.engine.sampling_params import SamplingParams


def __getattr__(name: str):
    from torpor.lazy import export  # the collector paused while the engine's modules load (lazy.py says why)

    return export("torpor.engine", _EXPORTS, name)
