"""torpor.memory's host backend: the CUDA contract on host memory, proved with real readings."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from torpor.memory import HostMemoryError, MemoryManager, TagAsleepError

MiB = 2**20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tag_of(mm: MemoryManager, t: torch.Tensor) -> str | None:
    seg = mm._backend.find(t.data_ptr())
    return None if seg is None else seg.tag


@pytest.fixture
def mm(tmp_path):
    return MemoryManager("cpu", backup_dir=str(tmp_path))


def test_tensors_made_in_a_scope_land_in_the_tag(mm):
    with mm.tag("weights"):
        made = {
            "empty": torch.empty(100),
            "zeros": torch.zeros(3, 5),
            "randn": torch.randn(64, 64),
            "arange": torch.arange(10),
            "tensor": torch.tensor([1.0, 2.0, 3.0]),
            "linear": torch.nn.Linear(16, 8).weight,
            "to": torch.ones(4).to(torch.float16),
            "strided": torch.empty_strided((4, 4), (1, 4)),
        }
        view = made["randn"][1:3]
    outside = torch.ones(10)
    assert {name: tag_of(mm, t) for name, t in made.items()} == dict.fromkeys(made, "weights")
    assert made["strided"].stride() == (1, 4)
    assert view.untyped_storage().data_ptr() == made["randn"].untyped_storage().data_ptr()
    assert tag_of(mm, outside) is None
    assert torch.equal(made["zeros"], torch.zeros(3, 5)) and torch.equal(made["arange"], torch.arange(10))
    assert mm.usage()["weights"].allocated_bytes >= 64 * 64 * 4


def test_nested_scopes_innermost_wins(mm):
    with mm.tag("runtime"):
        with mm.tag("kv_cache"):
            kv = torch.zeros(1000)
        block_tables = torch.zeros(100, dtype=torch.int32)
    assert tag_of(mm, kv) == "kv_cache" and tag_of(mm, block_tables) == "runtime"


def test_offload_and_discard_release_rss_and_keep_addresses(mm):
    with mm.tag("weights"):
        w = torch.randn(16 * MiB)  # 64 MiB
    with mm.tag("kv_cache"):
        kv = torch.ones(16 * MiB)
    ref, ptrs = w.clone(), (w.data_ptr(), kv.data_ptr())
    gc.collect()
    before = rss()
    report = mm.sleep({"weights": "offload", "kv_cache": "discard"})
    assert report.bytes_copied >= 64 * MiB and report.bytes_released >= 128 * MiB
    assert before - rss() >= 120 * MiB  # both tags' pages went back to the kernel
    usage = mm.usage()
    assert usage["weights"].offloaded_bytes == usage["weights"].reserved_bytes
    assert usage["kv_cache"].discarded_bytes == usage["kv_cache"].reserved_bytes
    wake = mm.wake()
    assert wake.bytes_copied == report.bytes_copied
    assert (w.data_ptr(), kv.data_ptr()) == ptrs
    assert torch.equal(w, ref)
    assert int(torch.count_nonzero(kv)) == 0
    kv.fill_(2.0)  # still usable memory after the wake
    assert float(kv.sum()) == 2.0 * kv.numel()


def test_selective_wake_and_noops(mm):
    with mm.tag("a"):
        a = torch.full((1000,), 3.0)
    with mm.tag("b"):
        torch.full((1000,), 4.0)
    mm.sleep({"a": "offload", "b": "offload"})
    assert mm.sleep({"a": "offload"}).tags == ()  # double sleep
    mm.wake(["a"])
    assert not mm.is_sleeping("a") and mm.is_sleeping("b") and mm.is_sleeping()
    assert float(a.sum()) == 3000.0
    mm.wake()
    assert mm.wake().tags == () and not mm.is_sleeping()  # double wake


def test_bad_input_is_refused(mm):
    with mm.tag("a"):
        torch.ones(10)
    with pytest.raises(ValueError, match="unknown tag 'x'"):
        mm.sleep({"x": "offload"})
    with pytest.raises(ValueError, match="unknown sleep action 'nap'"):
        mm.sleep({"a": "nap"})
    with pytest.raises(ValueError, match="unknown tag"):
        mm.wake(["x"])
    with pytest.raises(ValueError, match="non-empty string"), mm.tag(""):
        pass
    with pytest.raises(ValueError, match="host_backup"):
        MemoryManager("cpu", host_backup="cloud")
    mm.sleep({"a": "discard"})
    with pytest.raises(TagAsleepError), mm.tag("a"):
        pass
    mm.wake()
    with mm.tag("a"), pytest.raises(RuntimeError, match="scope is open"):
        mm.sleep({"a": "offload"})


def test_keep_and_deeper_sleep(mm):
    with mm.tag("w"):
        w = torch.ones(MiB)
    report = mm.sleep({"w": "keep"})
    assert report.tags == () and not mm.is_sleeping()
    mm.sleep({"w": "offload"})
    assert mm.usage()["w"].host_backup_bytes >= 4 * MiB
    mm.sleep({"w": "discard"})  # deeper: the host copy goes
    assert mm.usage()["w"].host_backup_bytes == 0
    mm.wake()
    assert int(torch.count_nonzero(w)) == 0


def test_host_budget_refuses_offload_and_everything_stays_awake(tmp_path):
    mm = MemoryManager("cpu", max_host_bytes=MiB, backup_dir=str(tmp_path))
    with mm.tag("w"):
        w = torch.randn(MiB)
    with mm.tag("kv"):
        torch.ones(MiB)
    ref = w.clone()
    with pytest.raises(HostMemoryError, match="max_host_bytes"):
        mm.sleep({"w": "offload", "kv": "discard"})
    assert not mm.is_sleeping()
    assert torch.equal(w, ref)


def test_backup_write_failure_leaves_everything_awake(tmp_path):
    """A real write failure: the file-size limit makes the backup file refuse the bytes."""
    code = textwrap.dedent(f"""
        import resource, signal, torch
        from torpor.memory import HostMemoryError, MemoryManager
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        mm = MemoryManager("cpu", backup_dir={str(tmp_path)!r})
        with mm.tag("w"):
            w = torch.randn(4 << 20)
        ref = w.clone()
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
        try:
            mm.sleep({{"w": "offload"}})
        except HostMemoryError as exc:
            print("refused:", exc)
        assert not mm.is_sleeping() and torch.equal(w, ref)
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        mm.sleep({{"w": "offload"}})
        mm.wake()
        assert torch.equal(w, ref)
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout and "nothing was released" in result.stdout
    assert result.stdout.strip().endswith("ok")


def test_a_first_sleep_that_fails_midway_releases_nothing_and_keeps_no_buffer(tmp_path):
    """A sleep with host copies still to make makes each one and queues its copy before making the next: a failure at
    the second (a real one: the file-size limit) must leave every tag awake with its bytes, the discarded tag's too,
    and give back the copy made for the first."""
    code = textwrap.dedent(f"""
        import os, resource, signal, torch
        from torpor.memory import HostMemoryError, MemoryManager
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        mm = MemoryManager("cpu", backup_dir={str(tmp_path)!r})
        with mm.tag("w"):
            small = torch.randn(1 << 16)     # 256 KiB: its copy fits under the limit
            big = torch.randn(16 << 20)      # 64 MiB, a segment of its own: its copy does not
        with mm.tag("kv"):
            kv = torch.randn(1 << 20)
        assert mm.usage()["w"].num_segments == 2
        refs = [t.clone() for t in (small, big, kv)]
        fds = len(os.listdir("/proc/self/fd"))
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
        try:
            mm.sleep({{"w": "offload", "kv": "discard"}})
        except HostMemoryError as exc:
            print("refused:", exc)
        assert not mm.is_sleeping()
        assert all(torch.equal(t, r) for t, r in zip((small, big, kv), refs))
        assert len(os.listdir("/proc/self/fd")) == fds, "a host copy made before the failure was kept"
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        mm.sleep({{"w": "offload", "kv": "discard"}})
        mm.wake()
        assert torch.equal(small, refs[0]) and torch.equal(big, refs[1]) and not kv.any()
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout and "nothing was released" in result.stdout
    assert result.stdout.strip().endswith("ok")


def test_a_sleep_whose_copies_fail_after_the_discards_went_maps_them_again(mm, monkeypatch):
    """With every host copy made already, the discarded tags go back before the copies out start (so the driver's
    clearing overlaps them); copies that then fail must not leave those tags unmapped while the engine runs on."""
    with mm.tag("w"):
        w = torch.randn(MiB)
    with mm.tag("kv"):
        kv = torch.randn(MiB)
    ref = w.clone()
    mm.sleep({"w": "offload", "kv": "discard"})
    mm.wake()
    backend = mm._backend

    def failing(segments):
        raise HostMemoryError("the copies failed")

    monkeypatch.setattr(backend, "_copy_out", failing)
    with pytest.raises(HostMemoryError, match="the copies failed"):
        mm.sleep({"w": "offload", "kv": "discard"})
    assert not mm.is_sleeping() and all(seg.resident for seg in backend.segments.values())
    assert torch.equal(w, ref) and not kv.any()  # the discarded tag came back as a discard's wake makes it
    kv.fill_(2.0)
    monkeypatch.undo()
    mm.sleep({"w": "offload", "kv": "discard"})
    mm.wake()
    assert torch.equal(w, ref)


def test_freed_tensors_give_chunks_back(mm):
    with mm.tag("w"):
        big = torch.empty(32 * MiB, dtype=torch.uint8)
        small = torch.ones(100)
    assert mm.usage()["w"].num_segments == 2
    del big
    gc.collect()
    assert mm.usage()["w"].num_segments == 1
    del small
    gc.collect()
    assert mm.usage()["w"].num_segments == 0


def test_threads_allocate_in_their_own_tags(mm):
    results: dict[str, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def work(tag: str) -> None:
        try:
            with mm.tag(tag):
                results[tag] = [torch.full((1000 + i,), float(i)) for i in range(50)]
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(f"t{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    outside = [torch.ones(10) for _ in range(50)]  # this thread is in no scope meanwhile
    for t in threads:
        t.join()
    assert not errors
    assert all(tag_of(mm, t) == tag for tag, ts in results.items() for t in ts)
    assert all(tag_of(mm, t) is None for t in outside)
    mm.sleep({tag: "offload" for tag in results})
    mm.wake()
    assert all(float(t[0]) == i for ts in results.values() for i, t in enumerate(ts))


def test_several_managers_innermost_wins(tmp_path):
    outer, inner = MemoryManager("cpu", backup_dir=str(tmp_path)), MemoryManager("cpu", backup_dir=str(tmp_path))
    with outer.tag("x"):
        a = torch.ones(100)
        with inner.tag("y"):
            b = torch.ones(100)
    assert tag_of(outer, a) == "x" and tag_of(inner, b) == "y" and tag_of(outer, b) is None
    inner.sleep({"y": "discard"})
    assert float(a.sum()) == 100 and not outer.is_sleeping()
    inner.wake()


def test_audit_reports_late_allocations_with_their_stack(mm):
    with mm.tag("runtime"):
        torch.zeros(100)
    mm.seal("runtime")
    assert mm.audit().late_allocations == ()
    with mm.tag("runtime"):
        late = torch.zeros(1000)  # noqa: F841 - the leak under test
    (leak,) = mm.audit().late_allocations
    assert leak.tag == "runtime" and leak.nbytes >= 4000
    assert "test_audit_reports_late_allocations_with_their_stack" in leak.where
    assert mm.usage()["runtime"].sealed


def test_bench_memory_command_runs_and_reports_identical(tmp_path, capsys):
    from torpor.cli.main import main

    out = tmp_path / "bench.json"
    command = ["bench", "memory", "--device", "cpu", "--size", "0.03", "--num-small", "8", "--cycles", "2"]
    assert main([*command, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 and all(r["identical"] and r["sleep_s"] > 0 and r["wake_s"] > 0 for r in rows)
    assert "sleep (offload) and wake (restore)" in capsys.readouterr().out


def test_reserve_host_makes_the_copies_ahead_of_the_first_sleep(tmp_path):
    mm = MemoryManager("cpu", backup_dir=str(tmp_path), max_host_bytes=8 * MiB)
    with mm.tag("w"):
        w = torch.randn(MiB)  # 4 MiB
    with mm.tag("big"):
        big = torch.ones(4 * MiB)  # 16 MiB: over the host budget
    assert mm.usage()["w"].host_backup_bytes == 0
    assert mm.reserve_host(["w"]) >= 4 * MiB
    backups = [s.backup for s in mm._backend.of_tag("w")]
    assert mm.usage()["w"].host_backup_bytes >= 4 * MiB
    with pytest.raises(HostMemoryError, match="max_host_bytes"):
        mm.reserve_host(["big"])
    assert mm.usage()["big"].host_backup_bytes == 0
    with pytest.raises(ValueError, match="unknown tag"):
        mm.reserve_host(["nope"])
    ref = w.clone()
    mm.sleep({"w": "offload"})
    assert [s.backup for s in mm._backend.of_tag("w")] == backups  # the sleep used the reserved copies
    mm.wake()
    assert torch.equal(w, ref) and float(big[0]) == 1.0


def test_pinned_buffers_refuse_more_than_the_host_has_before_touching_it():
    """Large pinned copies are mmaps touched before registration: asking for more than MemAvailable must
    be a MemoryError (the CUDA backend turns it into HostMemoryError), not a visit of the OOM killer."""
    from torpor.memory.host_buffer import HostBuffer, check_available

    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    with pytest.raises(MemoryError, match="MiB available"):
        check_available(2 * total)
    with pytest.raises(MemoryError, match="MiB available"):
        HostBuffer.allocate(2 * total, "pinned")  # refused before any CUDA call
    check_available(MiB)  # a small one is fine


def test_a_host_buffer_dropped_without_free_gives_its_memory_back():
    """An engine that is never closed drops its buffers: collected, they unmap (after any unpinning)."""
    import ctypes

    from torpor.memory.host_buffer import HostBuffer

    buffer = HostBuffer.allocate(64 * MiB, "pageable")
    mapping = buffer._mmap
    ctypes.memset(buffer.ptr, 1, 64 * MiB)
    held = rss()
    del buffer
    gc.collect()
    assert mapping.closed and rss() < held - 60 * MiB
    freed = HostBuffer.allocate(MiB, "pageable")
    freed.free()  # an explicit free runs the release once; collecting the object afterwards does nothing
    mapping = freed._mmap
    del freed
    gc.collect()
    assert mapping.closed


def test_host_budget_error_names_the_bytes(tmp_path):
    """Below 1 MiB the budget error said "needs 0 MiB more; 0 MiB are held and max_host_bytes is 0 MiB"."""
    mm = MemoryManager("cpu", max_host_bytes=1024, backup_dir=str(tmp_path))
    with mm.tag("weights"):
        w = torch.ones(4096)  # 16 KiB
    with pytest.raises(HostMemoryError, match=r"needs 16384 bytes more .* 0 bytes are held and max_host_bytes is "
                                              r"1024 bytes"):
        mm.sleep({"weights": "offload"})
    assert not mm.is_sleeping("weights") and torch.all(w == 1)


def test_host_budget_counts_the_growth_of_an_existing_backup(tmp_path):
    """A backup made for a few bytes was reused for whatever the chunk held at the next offload: with
    max_host_bytes=2 MiB a second offload wrote 7 MiB of backup and succeeded."""
    mm = MemoryManager("cpu", max_host_bytes=2 * MiB, backup_dir=str(tmp_path))
    with mm.tag("w"):
        first = torch.ones(256)  # 1 KiB: its offload makes a 1 KiB backup
    mm.sleep({"w": "offload"})
    mm.wake()
    with mm.tag("w"):
        grown = torch.ones(7 * MiB // 4)  # 7 MiB in the same chunk
    with pytest.raises(HostMemoryError, match="max_host_bytes"):
        mm.sleep({"w": "offload"})
    assert not mm.is_sleeping("w") and torch.all(grown == 1) and torch.all(first == 1)
    assert mm.usage()["w"].host_backup_bytes <= 2 * MiB


def test_many_small_tensors_freed_in_any_order_merge_back(mm):
    """10,000 small tensors freed in random order (each free merges with its neighbours only, found by
    bisection: 0.2 s where re-sorting the whole free list took 2.8 s, measured once, not asserted): the free
    list stays exact, everything merges back."""
    with mm.tag("s"):
        xs = [torch.full((4,), float(i)) for i in range(10_000)]
        keep = torch.full((4,), -1.0)
    order = torch.randperm(len(xs), generator=torch.Generator().manual_seed(0)).tolist()
    for i in order:
        xs[i] = None
    gc.collect()
    (chunk,) = mm._backend.of_tag("s")
    assert chunk.allocated == 64 and len(chunk.free_ranges) <= 2
    assert sum(size for _, size in chunk.free_ranges) == chunk.size - 64
    mm.sleep({"s": "offload"})
    mm.wake()
    assert torch.all(keep == -1)


def test_one_tag_name_is_one_tag_not_its_letters(mm):
    """`wake("weights")` iterated the string: "unknown tag 'w' (known tags: weights)"."""
    with mm.tag("weights"):
        w = torch.ones(1000)
    assert mm.reserve_host("weights") > 0
    mm.sleep({"weights": "offload"})
    assert mm.wake("weights").tags[0].tag == "weights"
    assert torch.all(w == 1)
    assert mm.reserve_host_in_background("weights").wait(30)
    with pytest.raises(ValueError, match="unknown tag 'kv'"):
        mm.wake("kv")


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation")
def test_quantized_tensors_can_be_made_in_a_scope(mm):
    """A quantized output was re-placed with `set_`, which loses its quantizer: an INTERNAL ASSERT."""
    with mm.tag("q"):
        q = torch.quantize_per_tensor(torch.arange(8.0), 0.5, 0, torch.quint8)
        plain = q.dequantize()
    assert torch.equal(plain, torch.arange(8.0)) and tag_of(mm, plain) == "q"


def test_sleep_of_a_list_says_it_takes_a_mapping(mm):
    """`mm.sleep(["weights"])` was "AttributeError: 'list' object has no attribute 'items'"."""
    with mm.tag("weights"):
        torch.ones(10)
    with pytest.raises(TypeError, match=r"mapping of tag to action.*\['weights'\]"):
        mm.sleep(["weights"])
    with pytest.raises(TypeError, match="mapping of tag to action"):
        mm.check_sleep(["weights"])
    assert not mm.is_sleeping()
