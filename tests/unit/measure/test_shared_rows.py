"""The shared-memory exchange of a step's rows, with several ranks' mappings in one process (no collective)."""

import glob
import os

import pytest
import torch

from healthcheck.measure import shared_rows, step_gather


@pytest.fixture
def ranks():
    """Three ranks' views of one file, made and unlinked as :func:`shared_rows.attach` does."""
    assert shared_rows.available(), "the fence extension was not built: pip install -e . (setup.py) compiles it"
    world, capacity, results = 3, 10 + shared_rows.SPARE, 100
    size = shared_rows.file_size(world, capacity, results)
    header = [12345.0, world, capacity, shared_rows.SLOTS, results]
    path = shared_rows._create(size, header)
    assert path and os.path.exists(path)
    views = [
        shared_rows.SharedRows(shared_rows._map(path, size, header), r, world, capacity, timeout_s=0.2, results=results)
        for r in range(world)
    ]
    shared_rows._unlink(path)
    yield views
    for view in views:
        view.close()
        view.close()  # idempotent: a monitor may close after a failure path already did


def _row(rank: int, step: int, width: int = 10) -> torch.Tensor:
    return torch.arange(width, dtype=torch.float64) + 100 * rank + 1000 * step


def test_every_rank_reads_every_row_once_all_have_posted(ranks):
    posts = [view.post(_row(view.rank, 0)) for view in ranks[:2]]
    assert all(not work.is_completed() for work, _ in posts)  # the third rank has not written yet
    work, rows = ranks[2].post(_row(2, 0))
    work.wait()
    assert torch.equal(rows, torch.stack([_row(r, 0) for r in range(3)]))
    for work, rows in posts:
        assert work.is_completed() and torch.equal(rows, torch.stack([_row(r, 0) for r in range(3)]))


def test_slots_alternate_and_a_wider_row_is_refused(ranks):
    for step in range(5):  # more steps than slots: each read before the next post, as a training loop does
        posted = [view.post(_row(view.rank, step)) for view in ranks]
        for work, rows in posted:
            work.wait()
            assert torch.equal(rows, torch.stack([_row(r, step) for r in range(3)]))
    assert ranks[0].post(torch.zeros(ranks[0].capacity + 1, dtype=torch.float64)) is None


def test_a_missing_rank_times_out_and_an_overwritten_post_is_an_error(ranks):
    work, _ = ranks[0].post(_row(0, 0))
    assert not step_gather.finished_within(step_gather.InFlight(0, "sketch", 3, work, None, [], None, 0), 0.05)
    with pytest.raises(RuntimeError, match="still lacks a rank's row"):
        work.wait()
    for step in range(3):  # rank 1 runs two posts ahead: its row of post 1 is gone
        ranks[1].post(_row(1, step))
    ranks[2].post(_row(2, 0))
    with pytest.raises(RuntimeError, match="rows were overwritten before they were read"):
        work.is_completed()


def test_exactly_one_rank_claims_a_post_and_the_others_read_what_it_published(ranks):
    for step in range(4):  # every slot twice: a slot's claim and stamps move on with the post number
        posted = [view.post(_row(view.rank, step)) for view in ranks]
        post = posted[0][0].post
        assert [view.published(post) for view in ranks] == [None] * 3  # nothing yet: each would compute itself
        assert [view.claim(post) for view in ranks] == [True, False, False]
        assert not ranks[0].claim(post)  # a claim is had once
        payload = bytes(range(step, step + 40))
        assert ranks[0].publish(post, payload)
        assert all(view.published(post) == payload for view in ranks)
        for work, _ in posted:
            work.wait()
    assert ranks[1].claim(post + 1) and not ranks[1].publish(post + 1, bytes(101))  # too big: nobody reads it
    assert ranks[2].published(post + 1) is None


def test_published_metrics_overwritten_are_an_error(ranks):
    ranks[0].publish(3, b"three")
    ranks[0].publish(5, b"five")  # the same slot, two posts on
    with pytest.raises(RuntimeError, match="post 3's metrics were overwritten before they were read"):
        ranks[1].published(3)
    slot = ranks[0]._results[1]
    slot[1] = 7  # a writer began post 7 while this read copied post 5's bytes
    with pytest.raises(RuntimeError, match="post 5's metrics were overwritten while they were read"):
        ranks[1].published(5)


def test_a_file_of_another_run_is_not_mapped(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_rows, "DIRECTORY", str(tmp_path))
    path = shared_rows._create(4096, [1.0, 2.0, 3.0, 2.0])
    assert shared_rows._map(path, 4096, [9.0, 2.0, 3.0, 2.0]) is None  # another token
    assert shared_rows._map(path, 8192, [1.0, 2.0, 3.0, 2.0]) is None  # another size
    assert shared_rows._map(str(tmp_path / "gone"), 4096, [1.0, 2.0, 3.0, 2.0]) is None  # another host's file
    mapped = shared_rows._map(path, 4096, [1.0, 2.0, 3.0, 2.0])
    assert mapped is not None
    mapped.close()
    shared_rows._unlink(path)
    assert not glob.glob(str(tmp_path / "healthcheck-rows-*"))


def test_a_file_that_cannot_be_made_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_rows, "DIRECTORY", str(tmp_path / "missing"))  # no such directory: no shared rows
    assert shared_rows._create(4096, [1.0, 2.0, 3.0, 2.0]) == ""
    monkeypatch.setattr(shared_rows, "DIRECTORY", str(tmp_path))

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shared_rows.os, "posix_fallocate", full)  # a full tmpfs: refused now, not SIGBUS later
    assert shared_rows._create(4096, [1.0, 2.0, 3.0, 2.0]) == ""
    assert not list(tmp_path.iterdir())
