"""The staged loader (weights/staging.py) against the plain one, bit for bit: single file and shards,
tied embeddings, fused q/k/v and gate/up, dtype conversion, tensor-parallel slices; every bad file a
`CheckpointError` naming it; shard names that leave the folder refused."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from torpor.engine.attention.torch_backend import TorchAttentionBackend
from torpor.engine.distributed import TPGroup
from torpor.engine.models import ModelConfig, build_model
from torpor.engine.weights.index import CheckpointError
from torpor.engine.weights.loader import iter_checkpoint, load_weights, load_weights_reference, plan_checkpoint
from torpor.engine.weights.staging import StagingBuffers, copy_planned
from torpor.synthetic import make_model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("staged")
    return {
        "qwen2": make_model("tiny-qwen2", root / "qwen2", progress=False),  # qkv biases, tied embeddings
        "llama": make_model("tiny-llama", root / "llama", progress=False, max_shard_bytes=150_000),  # 3+ shards
    }


def new_model(path, dtype=torch.float32):
    return build_model(ModelConfig.from_pretrained(path), TorchAttentionBackend(), dtype=dtype)


def garbage_model(path, dtype):
    model = new_model(path, dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)  # anything the load must overwrite
    return model


def assert_same(a, b) -> None:
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert pa.dtype == pb.dtype and torch.equal(pa.view(torch.uint8), pb.view(torch.uint8)), name


@pytest.mark.parametrize("name", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bit_identical_to_the_plain_loader(checkpoints, name, dtype):
    path = checkpoints[name]
    reference = garbage_model(path, dtype)
    load_weights_reference(reference, path)
    # Small buffers: tensors split over several pieces, batches reuse buffers, several reads in flight.
    staging = StagingBuffers("cpu", buffer_bytes=8192, count=3, threads=2, keep=True)
    staged = garbage_model(path, dtype)
    load_weights(staged, path, staging)
    assert_same(staged, reference)
    assert all(torch.equal(a, b) for a, b in zip(staged.buffers(), reference.buffers(), strict=True))
    addresses = [p.data_ptr() for p in staged.parameters()]
    buffers = [b.ptr for b in staging.buffers]
    load_weights(staged, path, staging)  # the same buffers again, the same parameter addresses
    assert [b.ptr for b in staging.buffers] == buffers
    assert [p.data_ptr() for p in staged.parameters()] == addresses
    assert_same(staged, reference)
    staging.close()


def test_default_staging_reads_each_needed_byte_once(checkpoints):
    path = checkpoints["llama"]
    model = new_model(path)
    entries, copies = plan_checkpoint(model, path)
    staging = StagingBuffers("cpu")
    read = copy_planned(entries, copies, staging)
    staging.close()
    assert read == sum(e.nbytes for e in entries)  # untied llama: every tensor is needed, none twice


def test_the_cuda_default_is_the_sweeps_best_set():
    """32 x 32 MiB pinned buffers, read by up to 32 threads (the cores permitting): the best of the H200
    sweep of buffer sets (docs/weights.md)."""
    staging = StagingBuffers("cuda")  # nothing is allocated before a load
    assert (staging.count, staging.buffer_bytes >> 20) == (32, 32)
    assert staging.threads == min(32, os.cpu_count() or 1) and staging.kind == "pinned"


def test_tensor_parallel_ranks_read_their_slices(checkpoints):
    """Each rank's parameters equal the plain loader's at that rank; row slices read only their bytes."""
    path = checkpoints["llama"]
    full = new_model(path)
    load_weights_reference(full, path)
    total = sum(e.nbytes for e in plan_checkpoint(full, path)[0])
    for rank in (0, 1):
        with TPGroup(rank, 2).active():  # the layers and loaders shard as this rank of two
            reference, staged = garbage_model(path, torch.float32), garbage_model(path, torch.float32)
            load_weights_reference(reference, path)
            entries, copies = plan_checkpoint(staged, path)
            read = copy_planned(entries, copies, StagingBuffers("cpu", buffer_bytes=4096, count=2))
        assert_same(staged, reference)
        assert read < 0.75 * total  # column-sharded tensors: half their bytes
        qkv = staged.model.layers[1].self_attn.qkv_proj.weight
        q_rows = full.config.q_size // 2
        q_full = full.model.layers[1].self_attn.qkv_proj.weight[: full.config.q_size]
        assert torch.equal(qkv[:q_rows], q_full[rank * q_rows : (rank + 1) * q_rows])


# ---- bad files ------------------------------------------------------------------------------------
def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_bad_files_raise_checkpoint_error_naming_the_file(checkpoints, tmp_path):
    src = checkpoints["qwen2"]
    model = new_model(src)
    file = "model.safetensors"
    raw = (src / file).read_bytes()
    cases = {
        "empty": (b"", "truncated"),
        "short": (raw[:5], "truncated"),
        "truncated": (raw[: len(raw) // 2], "truncated"),
        "garbage": (b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"\0" * 64, "garbage header"),
        "huge_header": (b"\xff" * 8 + b"{}", "header length"),
        "bad_offsets": (None, "data_offsets"),
    }
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    name = next(n for n in header if n != "__metadata__")
    header[name]["data_offsets"][1] += 2
    blob = json.dumps(header).encode()
    cases["bad_offsets"] = (len(blob).to_bytes(8, "little") + blob + raw[8 + header_len :], "data_offsets")
    for case, (content, problem) in cases.items():
        path = _copy(src, tmp_path / case)
        (path / file).write_bytes(content)
        for load in (load_weights, load_weights_reference):
            with pytest.raises(CheckpointError, match=rf"^{file}: .*{problem}"):
                load(model, path)
        with pytest.raises(CheckpointError, match=rf"^{file}: "):
            list(iter_checkpoint(path))


def _sharded(src, dst, rename=None):
    """A copy of the sharded checkpoint `src` whose index maps the first shard's tensors to `rename`."""
    path = _copy(src, dst)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"] = {n: (rename if f == first else f) for n, f in index["weight_map"].items()}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path, first


def test_index_naming_bad_or_missing_shards(checkpoints, tmp_path):
    src = checkpoints["llama"]
    model = new_model(src)
    path, _ = _sharded(src, tmp_path / "config", "config.json")
    with pytest.raises(CheckpointError, match=r"shard name 'config.json' is not a \.safetensors file"):
        load_weights(model, path)
    path, _ = _sharded(src, tmp_path / "missing", "model-00009-of-00009.safetensors")
    with pytest.raises(CheckpointError, match=r"^model-00009-of-00009\.safetensors: shard listed .* missing"):
        load_weights(model, path)
    path, _ = _sharded(src, tmp_path / "text", "notes.safetensors")
    (path / "notes.safetensors").write_text("hello, not a checkpoint\n" * 10)
    with pytest.raises(CheckpointError, match=r"^notes\.safetensors: not a safetensors file"):
        load_weights(model, path)
    for broken in ("{broken", '{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}"):
        (path / "model.safetensors.index.json").write_text(broken)
        with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: not a readable JSON index"):
            load_weights(model, path)


def test_shard_names_that_leave_the_folder_are_refused(checkpoints, tmp_path):
    src = checkpoints["llama"]
    model = new_model(src)
    outside = tmp_path / "outside.safetensors"
    save_file({"x": torch.zeros(2)}, str(outside))
    for case, name in [("absolute", str(outside)), ("dotdot", "../outside.safetensors"),
                       ("nested", "sub/../../outside.safetensors")]:
        path, _ = _sharded(src, tmp_path / case, name)
        with pytest.raises(CheckpointError, match="leaves the checkpoint folder"):
            load_weights(model, path)
    path, first = _sharded(src, tmp_path / "symlink", "link.safetensors")
    os.symlink(path / first, path / "link.safetensors")  # a symlink inside the folder is fine
    load_weights(model, path)


def test_shards_linked_from_a_hugging_face_cache_snapshot_load(checkpoints, tmp_path):
    """A Hugging Face cache snapshot: `snapshots/<rev>/*` are symlinks to `../../blobs/<hash>` (outside the
    snapshot folder); the shards' names stay inside it, so the checkpoint loads."""
    src = checkpoints["llama"]
    blobs, snapshot = tmp_path / "repo" / "blobs", tmp_path / "repo" / "snapshots" / "rev"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(src.iterdir())):
        blob = blobs / f"blob{i}"
        shutil.copy(file, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    model = new_model(src)
    load_weights(model, snapshot)
    reference = new_model(src)
    load_weights(reference, src)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values(),
                                                   strict=True))


def test_duplicate_tensor_across_shards(checkpoints, tmp_path):
    src = checkpoints["llama"]
    path = _copy(src, tmp_path / "dup")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    save_file({"model.norm.weight": torch.ones(64)}, str(path / "extra.safetensors"))
    index["weight_map"]["model.norm.weight.copy"] = "extra.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"\.safetensors: tensor 'model\.norm\.weight' is also in"):
        load_weights(new_model(src), path)


def test_file_shrinking_after_the_plan_is_a_written_failure(checkpoints, tmp_path):
    """Headers were fine, the data then vanished (the file was replaced while loading): the error says the
    weights were written in part, so the engine stops serving them."""
    path = _copy(checkpoints["qwen2"], tmp_path / "shrinks")
    model = new_model(path)
    entries, copies = plan_checkpoint(model, path)
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: the file ended early") as error:
        copy_planned(entries, copies, StagingBuffers("cpu", buffer_bytes=4096, count=2))
    assert error.value.weights_written


def _rewrite_header(file, change, data=None) -> None:
    """`file` with `change(header)` applied to its parsed header (and its data section replaced by `data`)."""
    raw = file.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    blob = change(header) if change else None
    blob = blob if isinstance(blob, bytes) else json.dumps(header).encode()
    body = raw[8 + length :]
    file.write_bytes(len(blob).to_bytes(8, "little") + blob + (body if data is None else data(body)))


def _first_tensor(header) -> str:
    return min((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])


def _shift(header, by: int) -> None:
    for name, info in header.items():
        if name != "__metadata__":
            info["data_offsets"] = [o + by for o in info["data_offsets"]]


def _alias_first(header) -> None:
    """One more tensor over the first tensor's bytes."""
    header["alias"] = dict(header[_first_tensor(header)])


# Headers the safetensors library refuses (so the plain loader fails on them midway), and header JSON that
# made the checks themselves crash: each a CheckpointError naming the file, before a byte is written.
BAD_HEADERS = {
    "trailing bytes": (None, lambda data: data + b"\0" * 100, "100 bytes after the last tensor's data"),
    "gap before the data": (lambda h: _shift(h, 64), lambda data: b"\0" * 64 + data, "leaves 64 bytes unused"),
    "two tensors on the same bytes": (_alias_first, None, "overlaps the tensor before it"),
    "metadata not strings": (lambda h: h.update({"__metadata__": [1, 2]}), None, "__metadata__ is not an object"),
    "duplicate name": (lambda h: json.dumps(h)[:-1].encode() + b", " + json.dumps(_first_tensor(h)).encode() + b": "
                       + json.dumps(h[_first_tensor(h)]).encode() + b"}", None, "appears twice"),
    "nested past the recursion limit": (lambda h: b'{"__metadata__": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None,
                                        "garbage header"),
    "dtype a list": (lambda h: h[_first_tensor(h)].update({"dtype": ["F32"]}), None, "unknown dtype"),
    "dimension beyond int64": (lambda h: h[_first_tensor(h)].update({"shape": [0, 1 << 70], "data_offsets": [0, 0]}),
                               None, "64-bit integers"),
}


@pytest.mark.parametrize("case", list(BAD_HEADERS))
def test_bad_headers_in_a_later_shard_write_nothing(checkpoints, tmp_path, case):
    change, data, problem = BAD_HEADERS[case]
    src = checkpoints["llama"]
    path = _copy(src, tmp_path / "bad")
    last = sorted(path.glob("*.safetensors"))[-1]
    _rewrite_header(last, change, data)
    model = new_model(src)
    load_weights(model, src)
    before = [p.clone() for p in model.parameters()]
    for load in (load_weights, load_weights_reference):
        with pytest.raises(CheckpointError, match=rf"^{last.name}: .*{problem}") as error:
            load(model, path)
        assert not error.value.weights_written
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
