"""The trainer's side of vLLM's native weight transfer, against a torpor engine (docs/rl.md): what vLLM's own
trainer helpers send (`vllm/distributed/weight_transfer/`), made here for torpor's transports.

    client = HTTPWeightTransferClient(url, admin_token)        # vLLM's HTTPVLLMWeightSyncClient's four calls
    client.init_weight_transfer_engine({})                      # ipc
    client.start_weight_update()
    client.update_weights(ipc_update_info(model.named_parameters()))
    client.finish_weight_update("step-1")

    # nccl: the engine joins while this process, rank 0, forms the group; then each update broadcasts while pending
    group = trainer_init({"master_address": addr, "master_port": port, "world_size": 1 + engine_ranks})
    send_weights(client, model.named_parameters(), group, packed=True)

ipc: one handle per tensor, keyed by this device ("cpu", or the GPU's UUID as vLLM's trainers key it); on CPU the
tensors travel as shared-memory files (torch's `file_system` sharing, a ForkingPickler pickle: torpor's restricted
unpickler maps them), on CUDA as CUDA IPC handles. Keep the tensors alive until the answer came.

nccl: vLLM's trainer forms the group with its StatelessProcessGroup + PyNccl, whose store handshake is the one torpor
uses (the trainer, rank 0, hosts a TCPStore with `world_size` at master_address:master_port and every other rank
counts itself in), but whose NCCL communicator forms from an ncclUniqueId the trainer puts in that store
(`broadcast_from/0/0`), which torpor's torch process group does not read: so the trainer's side is this module's
`trainer_init` (torch's group on the same store; gloo on CPU, NCCL on CUDA), then a broadcast from rank 0 per tensor
or per packed buffer, exactly as vLLM's `trainer_send_weights` sends them.
"""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterable, Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from torpor.engine.weights.transfer_info import DEFAULT_PACKED_BUFFER_BYTES, TRANSFER_GROUP, device_key
from torpor.engine.weights.transport import DEFAULT_GROUP_TIMEOUT_S, UpdateGroup, broadcast, open_update_group


def dtype_name(dtype: torch.dtype) -> str:
    """vLLM's dtype_names entry: "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def pickle_handles(handles: list | dict) -> str:
    """`ipc_handles_pickled`: base64 of a ForkingPickler pickle (CPU storages as shared-memory files)."""
    torch.multiprocessing.set_sharing_strategy("file_system")  # a file an unrelated process (the engine) can open
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(handles)
    return base64.b64encode(buffer.getvalue()).decode()


def ipc_update_info(named_tensors: Iterable[tuple[str, torch.Tensor]], pickled: bool = True) -> dict:
    """One unpacked IPC chunk: every tensor's handle keyed by its device (`pickled`: as `ipc_handles_pickled`, the
    HTTP form; else the handles themselves, for an in-process LLM). The tensors must stay alive until the answer."""
    torch.multiprocessing.set_sharing_strategy("file_system")  # before any tensor is shared: files, not fds
    names, dtypes, shapes, handles = [], [], [], []
    for name, tensor in named_tensors:
        tensor = tensor.detach().contiguous()
        if tensor.device.type == "cpu" and not tensor.is_shared():
            tensor.share_memory_()  # mapped by the engine from /dev/shm (a copy once, then the buffer is shared)
        names.append(name)
        dtypes.append(dtype_name(tensor.dtype))
        shapes.append(list(tensor.shape))
        handles.append({device_key(tensor.device): reduce_tensor(tensor)})
    info: dict[str, Any] = {"names": names, "dtype_names": dtypes, "shapes": shapes}
    info["ipc_handles_pickled" if pickled else "ipc_handles"] = pickle_handles(handles) if pickled else handles
    return info


def packed_ipc_update_infos(named_tensors: Iterable[tuple[str, torch.Tensor]],
                            buffer_bytes: int = DEFAULT_PACKED_BUFFER_BYTES, pickled: bool = True) -> Iterator[dict]:
    """vLLM's packed IPC chunks (`packed_ipc_producer`): the tensors copied into one reused uint8 buffer of
    `buffer_bytes`, one update_info per fill (`tensor_sizes`, one handle dict). A tensor larger than the buffer
    travels alone, the buffer grown to its size from then on (vLLM's chunks may exceed their size too). Send each
    chunk and wait for its answer before asking for the next: the next fill overwrites the buffer."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    buffer: torch.Tensor | None = None
    handle = None
    pending: list[tuple[str, torch.Tensor]] = []
    used = 0

    def chunk() -> dict:
        entry = {device_key(buffer.device): handle}  # one handle dict, the buffer's (vLLM's packed form)
        info: dict[str, Any] = {"names": [n for n, _ in pending],
                                "dtype_names": [dtype_name(t.dtype) for _, t in pending],
                                "shapes": [list(t.shape) for _, t in pending],
                                "tensor_sizes": [t.numel() * t.element_size() for _, t in pending]}
        info["ipc_handles_pickled" if pickled else "ipc_handles"] = pickle_handles(entry) if pickled else entry
        return info

    for name, tensor in named_tensors:
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        if used and used + flat.numel() > max(buffer_bytes, buffer.numel()):
            _synchronize(buffer.device)
            yield chunk()
            pending, used = [], 0
        if buffer is None or flat.numel() > buffer.numel():  # the first, or one larger than the buffer: grown
            buffer = torch.empty(max(buffer_bytes, flat.numel()), dtype=torch.uint8, device=tensor.device)
            if buffer.device.type == "cpu":
                buffer.share_memory_()
            handle = reduce_tensor(buffer)
        buffer[used:used + flat.numel()].copy_(flat)
        pending.append((name, tensor))
        used += flat.numel()
    if pending:
        _synchronize(buffer.device)
        yield chunk()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


# ---- nccl --------------------------------------------------------------------------------------------
def trainer_init(init_info: dict, device: torch.device | str | None = None,
                 timeout_s: float = DEFAULT_GROUP_TIMEOUT_S) -> UpdateGroup:
    """vLLM's `NCCLWeightTransferEngine.trainer_init(dict(master_address, master_port, world_size))`: this process
    is rank 0 of the engine's transfer group and returns once every rank joined (call it while the engine's
    init_weight_transfer_engine is pending). NCCL on a CUDA `device` (default: CUDA when available), gloo on CPU."""
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    return open_update_group(init_info["master_address"], int(init_info["master_port"]), 0,
                             int(init_info["world_size"]), TRANSFER_GROUP, None, device, timeout_s)


def trainer_send_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], group: UpdateGroup,
                         packed: bool = False, packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_BYTES) -> None:
    """vLLM's `trainer_send_weights`: every tensor broadcast from rank 0 in order, or (`packed`) uint8 buffers of
    consecutive tensors, each closed once it holds more than `packed_buffer_size_bytes` (vLLM's packing)."""
    if not packed:
        for _, tensor in named_tensors:
            broadcast(group, tensor.detach().to(group.device).contiguous())
        return
    pending, size = [], 0
    for _, tensor in named_tensors:
        pending.append(tensor.detach().to(group.device).contiguous().view(-1).view(torch.uint8))
        size += pending[-1].numel()
        if size > packed_buffer_size_bytes:
            broadcast(group, torch.cat(pending))
            pending, size = [], 0
    if pending:
        broadcast(group, torch.cat(pending))


def nccl_update_info(named_tensors: Iterable[tuple[str, torch.Tensor]], packed: bool = False) -> dict:
    """vLLM's NCCL update_info of these tensors (names, dtype_names, shapes, packed)."""
    pairs = list(named_tensors)
    return {"names": [n for n, _ in pairs], "dtype_names": [dtype_name(t.dtype) for _, t in pairs],
            "shapes": [list(t.shape) for _, t in pairs], "packed": packed}


def send_weights(client, named_tensors: Iterable[tuple[str, torch.Tensor]], group: UpdateGroup,
                 packed: bool = False, weight_version: str | None = None) -> None:
    """One whole nccl update, as vLLM's trainer engine runs it: start, then update_weights on a thread while this
    process broadcasts (they meet in the same collectives), then finish. Raises the engine's answer when it failed."""
    pairs = list(named_tensors)
    client.start_weight_update()
    failure: list[BaseException] = []

    def update() -> None:
        try:
            client.update_weights(nccl_update_info(pairs, packed))
        except BaseException as exc:
            failure.append(exc)

    receiving = threading.Thread(target=update, name="torpor-weight-transfer-update")
    receiving.start()
    try:
        trainer_send_weights(pairs, group, packed)
    finally:
        receiving.join()
    if failure:
        raise failure[0]
    client.finish_weight_update(weight_version)


class HTTPWeightTransferClient:
    """vLLM's `HTTPVLLMWeightSyncClient` for a torpor server: the four routes, the admin token as a bearer token.
    Each call raises `httpx.HTTPStatusError` with the server's answer when it failed."""

    def __init__(self, base_url: str, admin_token: str | None = None, timeout: float = 300.0) -> None:
        import httpx  # optional: only a client over HTTP needs it

        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)

    def _post(self, route: str, body: dict | None = None) -> dict:
        response = self.http.post(route, json=body)
        if response.is_error:
            response.raise_for_status()
        return response.json()

    def init_weight_transfer_engine(self, init_info: dict) -> dict:
        return self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> dict:
        return self._post("/start_weight_update")

    def update_weights(self, update_info: dict) -> dict:
        return self._post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> dict:
        return self._post("/finish_weight_update", None if weight_version is None else
                          {"weight_version": weight_version})

    def close(self) -> None:
        self.http.close()

