"""torpor: put a PyTorch LLM inference engine to sleep and wake it bit-identically.

`torpor.memory` is the memory layer (usable by any PyTorch program); `torpor.engine` the
inference engine built on it. Heavy modules are imported lazily.
"""

__version__ = "0.1.0"
