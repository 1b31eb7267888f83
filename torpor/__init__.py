"""torpor: put a PyTorch LLM inference engine to sleep and wake it bit-identically.

`torpor.memory` is the memory layer (usable by any PyTorch program); `torpor.engine` the
inference engine built on it. vLLM's entry points are here too, imported lazily (`import torpor`
does not import torch):

    from torpor import LLM, SamplingParams
    llm = LLM("Qwen/Qwen3-0.6B")                  # a Hub id (local cache, or downloaded) or a folder
    print(llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))[0].outputs[0].text)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {  # name -> module
    "LLM": "torpor.engine.llm",
    "SamplingParams": "torpor.engine.sampling_params",
    "RequestOutput": "torpor.engine.outputs",
    "CompletionOutput": "torpor.engine.outputs",
    "Logprob": "torpor.engine.logprobs",
    "EngineConfig": "torpor.engine.config",
}
__all__ = ["LLM", "CompletionOutput", "EngineConfig", "Logprob", "RequestOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from torpor.engine.config import EngineConfig
    from torpor.engine.llm import LLM
    from torpor.engine.logprobs import Logprob
    from torpor.engine.outputs import CompletionOutput, RequestOutput
    from torpor.engine.sampling_params import SamplingParams


def __getattr__(name: str):
    from torpor.lazy import export  # the collector paused while the engine's modules load (lazy.py says why)

    return export("torpor", _EXPORTS, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
