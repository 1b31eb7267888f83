"""Routed experts of a MoE model, as a request gets them back (`SamplingParams(return_routed_experts=True)`);
torch-free.

`CompletionOutput.routed_experts` is a numpy array [tokens, moe layers, top_k]: row i holds, for every sparse
layer (`ModelConfig.moe_layers`, in order; dense `mlp_only_layers` have no row), the k experts chosen, most
likely first, in the forward pass that produced output token i, i.e. at position prompt_len - 1 + i (the last
prompt token for the first output token, then each output token but the last). These are the last
`len(token_ids)` rows of what SGLang's `return_routed_experts` gives for positions 0 .. len - 2. The dtype is
int16 when the model has at most 32767 experts, else int32. The rows are append-only: the array of a streamed
output stays valid while the request runs on.

Over HTTP each choice (and each streamed chunk, for its new tokens) carries `routed_experts` = `encode(...)`:
{"data": base64 of the array's little-endian bytes in C order, "dtype": "int16" | "int32", "shape": [tokens,
layers, top_k]}; `decode` turns it back into the array. 768 bytes a token for Qwen3-30B-A3B (48 layers, top 8,
int16), a third more in base64.
"""

from __future__ import annotations

import base64

import numpy as np

INT16_MAX_EXPERTS = 32767


def expert_id_dtype(num_experts: int) -> np.dtype:
    return np.dtype(np.int16 if num_experts <= INT16_MAX_EXPERTS else np.int32)


class RoutedExperts:
    """One sequence's rows ([layers, top_k] each), in a growing array (doubling: O(1) per token, no copy for a
    snapshot: `rows()` is a view of the rows so far, which are never written again)."""

    def __init__(self) -> None:
        self._array: np.ndarray | None = None
        self._count = 0

    def append(self, row: np.ndarray) -> None:
        if self._array is None:
            self._array = np.empty((16, *row.shape), dtype=row.dtype)
        elif self._count == len(self._array):
            grown = np.empty((2 * len(self._array), *self._array.shape[1:]), dtype=self._array.dtype)
            grown[: self._count] = self._array
            self._array = grown
        self._array[self._count] = row
        self._count += 1

    def __len__(self) -> int:
        return self._count

    def rows(self) -> np.ndarray | None:
        """[rows so far, layers, top_k] (None before the first)."""
        return None if self._array is None else self._array[: self._count]


def encode(routed: np.ndarray) -> dict:
    """The HTTP form of `routed` [tokens, layers, top_k] (see the module docstring)."""
    data = np.ascontiguousarray(routed, dtype=routed.dtype.newbyteorder("<"))
    return {"data": base64.b64encode(data.tobytes()).decode("ascii"), "dtype": routed.dtype.name,
            "shape": list(routed.shape)}


def decode(encoded: dict) -> np.ndarray:
    """`encode`'s inverse: the [tokens, layers, top_k] array."""
    dtype = np.dtype(encoded["dtype"]).newbyteorder("<")
    return np.frombuffer(base64.b64decode(encoded["data"]), dtype=dtype).reshape(encoded["shape"])
