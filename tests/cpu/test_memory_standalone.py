"""`torpor.memory` imports and works with torch alone: none of the server's, the CLI's or the engine's packages
(FastAPI, uvicorn, pydantic, prometheus-client, rich, matplotlib, transformers, tokenizers, safetensors) is needed,
and no engine module is imported. Run in a fresh interpreter where importing any of them raises."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import importlib.abc, sys
BLOCKED = {"fastapi", "uvicorn", "pydantic", "prometheus_client", "rich", "matplotlib", "transformers",
           "tokenizers", "safetensors", "httpx", "huggingface_hub"}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked: {name}")
        return None

sys.meta_path.insert(0, Block())
import torch
from torpor.memory import MemoryManager
mm = MemoryManager("cpu")
with mm.tag("weights"):
    x = torch.arange(1 << 16, dtype=torch.float32)
expected = x.clone()
mm.sleep({"weights": "offload"})
mm.wake()
assert torch.equal(x, expected)
engine = sorted(m for m in sys.modules if m.startswith("torpor.") and not m.startswith(("torpor.memory", "torpor.env")))
assert not engine, engine
print("ok")
"""


def test_torpor_memory_needs_only_torch():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
