"""The run directory's JSON-lines writer: a step's rows reach the file whole."""

import json

from healthcheck.files import JsonlWriter, read_jsonl


class _CountingHandle:
    """A file handle that records each write, and raises as a SIGTERM would after the first one."""

    def __init__(self, handle):
        self.handle, self.writes = handle, 0

    def write(self, text):
        self.handle.write(text)
        self.writes += 1
        raise KeyboardInterrupt("a signal raised in Python right after this write")

    def flush(self):
        self.handle.flush()

    def close(self):
        self.handle.close()


def test_a_steps_rows_go_in_one_write_so_a_signal_cannot_split_them(tmp_path):
    path = tmp_path / "steps.jsonl"
    writer = JsonlWriter(path)
    counting = writer._handle = _CountingHandle(writer._handle)
    rows = [{"step": 2, "rank": r, "loss": 1.5 * r} for r in range(4)]
    try:
        writer.write_many(rows)
    except KeyboardInterrupt:
        pass
    writer.close()  # as the trainer's finally does: what was written reaches the file
    assert counting.writes == 1
    assert list(read_jsonl(path)) == rows


def test_single_rows_append_and_flush(tmp_path):
    path = tmp_path / "aggregates.jsonl"
    writer = JsonlWriter(path)
    writer.write({"step": 0, "x": float("nan")})
    assert json.loads(path.read_text().splitlines()[0])["step"] == 0  # flushed before close
    writer.write_many([])
    writer.close()
    assert len(path.read_text().splitlines()) == 1
