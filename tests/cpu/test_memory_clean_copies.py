"""Clean host copies (re-sleep without copying), their checksum check, writes into sleeping tags, and the
background host reservation, on the host backend (the same bookkeeping as CUDA's)."""

from __future__ import annotations

import pytest
import torch

from torpor.memory import MemoryManager, StaleCopyError

MiB = 2**20


@pytest.fixture
def mm(tmp_path):
    return MemoryManager("cpu", backup_dir=str(tmp_path))


def _weights(mm: MemoryManager, n: int = MiB) -> torch.Tensor:
    with mm.tag("weights"):
        return torch.randn(n)


def test_a_clean_tag_resleeps_without_copying(mm):
    w = _weights(mm)
    ref = w.clone()
    first = mm.sleep({"weights": "offload"})
    assert first.bytes_copied >= 4 * MiB
    mm.wake()
    assert mm.mark_clean("weights") >= 4 * MiB  # the bytes whose copy is kept
    again = mm.sleep({"weights": "offload"})
    assert again.bytes_copied == 0 and again.bytes_released == first.bytes_released
    mm.wake()
    assert torch.equal(w, ref)


def test_without_mark_clean_every_sleep_copies(mm):
    w = _weights(mm)  # noqa: F841 (the tag's memory lives as long as its tensor)
    mm.sleep({"weights": "offload"})
    mm.wake()
    assert mm.sleep({"weights": "offload"}).bytes_copied > 0


def test_mark_dirty_copies_again_and_the_write_survives(mm):
    w = _weights(mm)
    mm.sleep({"weights": "offload"})
    mm.wake()
    mm.mark_clean("weights")
    mm.mark_dirty("weights")
    w.fill_(7.0)
    assert mm.sleep({"weights": "offload"}).bytes_copied > 0
    mm.wake()
    assert torch.all(w == 7.0)


def test_a_tag_scope_marks_its_tag_dirty(mm):
    w = _weights(mm)
    mm.sleep({"weights": "offload"})
    mm.wake()
    mm.mark_clean("weights")
    with mm.tag("weights"):
        torch.ones(8)  # allocating in a tag writes it
    assert mm.sleep({"weights": "offload"}).bytes_copied > 0
    mm.wake()
    assert w.abs().sum() > 0


def test_undeclared_write_is_caught_by_the_checksum_switch(mm, monkeypatch):
    w = _weights(mm)
    mm.sleep({"weights": "offload"})
    mm.wake()
    mm.mark_clean("weights")
    w[0] = 12345.0  # a write nobody declared with mark_dirty
    monkeypatch.setenv("TORPOR_VERIFY_CLEAN_COPIES", "1")
    with pytest.raises(StaleCopyError, match="mark_dirty"):
        mm.sleep({"weights": "offload"})
    assert not mm.is_sleeping("weights") and w[0] == 12345.0  # nothing was released


def test_checksum_switch_passes_a_truly_clean_copy(mm, monkeypatch):
    w = _weights(mm)
    ref = w.clone()
    mm.sleep({"weights": "offload"})
    mm.wake()
    mm.mark_clean("weights")
    monkeypatch.setenv("TORPOR_VERIFY_CLEAN_COPIES", "1")
    assert mm.sleep({"weights": "offload"}).bytes_copied == 0
    mm.wake()
    assert torch.equal(w, ref)


def test_bad_environment_switch_is_refused(mm, monkeypatch):
    w = _weights(mm)  # noqa: F841
    monkeypatch.setenv("TORPOR_VERIFY_CLEAN_COPIES", "yes")
    with pytest.raises(ValueError, match="TORPOR_VERIFY_CLEAN_COPIES"):
        mm.sleep({"weights": "offload"})


def test_a_discarded_tag_has_no_clean_copy(mm):
    w = _weights(mm)
    mm.sleep({"weights": "offload"})
    mm.sleep({"weights": "discard"})  # deeper: the copy goes
    mm.wake()
    assert mm.mark_clean("weights") == 0
    w.fill_(3.0)
    assert mm.sleep({"weights": "offload"}).bytes_copied > 0
    mm.wake()
    assert torch.all(w == 3.0)


def test_mark_clean_refuses_a_sleeping_or_unknown_tag(mm):
    w = _weights(mm)  # noqa: F841
    mm.sleep({"weights": "offload"})
    with pytest.raises(ValueError, match="asleep"):
        mm.mark_clean("weights")
    with pytest.raises(ValueError, match="unknown tag"):
        mm.mark_dirty("brain")


# ---- writes into a sleeping tag -------------------------------------------------------------
def test_a_write_into_a_discarded_tag_while_asleep_is_zeroed_on_wake(mm):
    with mm.tag("kv_cache"):
        kv = torch.zeros(5000)
    mm.sleep({"kv_cache": "discard"})
    kv.fill_(1.0)  # the address range stays mapped on the host: the write lands in fresh pages
    assert kv.sum() == 5000
    mm.wake()
    assert kv.sum() == 0  # the contract: discarded memory comes back zero-filled


def test_a_write_into_an_offloaded_tag_while_asleep_is_undone_on_wake(mm):
    w = _weights(mm, 5000)
    ref = w.clone()
    mm.sleep({"weights": "offload"})
    assert w.abs().sum() == 0  # a read while asleep sees the released pages: zeros, never the old bytes
    w.fill_(9.0)
    mm.wake()
    assert torch.equal(w, ref)


# ---- the host copies reserved in the background ---------------------------------------------
def test_background_reservation_makes_every_copy(mm):
    with mm.tag("weights"):
        tensors = [torch.randn(3 * MiB) for _ in range(4)]  # 4 chunks of their own
    reservation = mm.reserve_host_in_background(["weights"])
    assert reservation.wait(60) and reservation.error is None
    assert reservation.reserved_bytes == mm.usage()["weights"].host_backup_bytes >= 4 * 12 * MiB
    refs = [t.clone() for t in tensors]
    mm.sleep({"weights": "offload"})
    mm.wake()
    assert all(torch.equal(t, r) for t, r in zip(tensors, refs, strict=True))


def test_a_sleep_takes_over_a_reservation_in_progress(mm):
    with mm.tag("weights"):
        tensors = [torch.randn(2 * MiB) for _ in range(12)]
    refs = [t.clone() for t in tensors]
    reservation = mm.reserve_host_in_background(["weights"])
    report = mm.sleep({"weights": "offload"})  # stops the reservation after its segment, copies the rest
    assert reservation.done
    assert report.bytes_copied >= 12 * 8 * MiB
    mm.wake()
    assert all(torch.equal(t, r) for t, r in zip(tensors, refs, strict=True))


def test_a_manager_dropped_during_its_reservation_closes_on_the_dropping_thread(tmp_path, monkeypatch):
    """The reservation's thread holds no reference to the manager: the owner's last reference closes it on the
    owner's thread (on CUDA a close on the reservation's thread could deadlock with the owner's next allocator
    call, which tests/gpu/test_engine.py hit), and the close stops the reservation first."""
    import gc
    import threading

    closed_on = []
    close = MemoryManager.close
    monkeypatch.setattr(MemoryManager, "close", lambda self: (closed_on.append(threading.current_thread()),
                                                              close(self))[1])
    mm = MemoryManager("cpu", backup_dir=str(tmp_path))
    with mm.tag("weights"):
        tensors = [torch.randn(2 * MiB) for _ in range(16)]
    reservation = mm.reserve_host_in_background(["weights"])
    del mm, tensors
    gc.collect()
    assert closed_on == [threading.current_thread()]
    assert reservation.done  # stopped by the close, after its segment in progress


def test_a_manager_collected_on_a_torpor_thread_is_closed_on_the_next_thread_that_makes_or_closes_one(tmp_path,
                                                                                                      monkeypatch):
    """The cyclic collector runs wherever Python allocates, torpor's background threads included: a manager it
    finalizes there is kept and closed later by the next manager made or closed (on CUDA a close on that thread
    could deadlock with the owner's allocator calls)."""
    import gc
    import threading

    from torpor.memory import close_deferred

    closed_on = []
    close = MemoryManager.close
    monkeypatch.setattr(MemoryManager, "close", lambda self: (closed_on.append(threading.current_thread().name),
                                                              close(self))[1])
    mm = MemoryManager("cpu", backup_dir=str(tmp_path))
    with mm.tag("weights"):
        torch.randn(1024)
    mm.cycle = mm  # only the collector frees it
    del mm
    gc.disable()  # the collection below must be the one that finds it
    try:
        collector = threading.Thread(target=gc.collect, name="torpor-test-collector")
        collector.start()
        collector.join()
    finally:
        gc.enable()
    assert closed_on == []  # deferred, not closed on the torpor thread
    other = MemoryManager("cpu", backup_dir=str(tmp_path))  # making one closes it, here
    assert closed_on == [threading.current_thread().name]
    assert close_deferred() == 0
    other.close()


def test_background_reservation_reports_a_host_memory_error(tmp_path):
    mm = MemoryManager("cpu", backup_dir=str(tmp_path), max_host_bytes=MiB)
    with mm.tag("weights"):
        w = torch.randn(2 * MiB)
    reservation = mm.reserve_host_in_background(["weights"])
    assert reservation.wait(60)
    assert "max_host_bytes" in str(reservation.error) and reservation.reserved_bytes == 0
    assert not mm.is_sleeping() and w.abs().sum() > 0
