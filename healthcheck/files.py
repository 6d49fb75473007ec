"""Reading and writing the files a run leaves: one reader that turns any error into one line, one
atomic writer, and the JSON-lines records.

Every artifact goes through here, so a torn write, a missing file or a hand-edited record always
ends the same way: readers never see half a file, and a bad file is a one-line error with exit 2.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator, TypeVar

from pydantic import BaseModel, ValidationError

from healthcheck.errors import HealthcheckError, InvalidInput, one_line
from healthcheck.finite import json_safe
from healthcheck.typed import format_validation_error

ModelT = TypeVar("ModelT", bound=BaseModel)


def read_text(path: Path | str, *, missing: str, unreadable: str, error: type[HealthcheckError] = InvalidInput) -> str:
    """The file's UTF-8 text, or ``error`` with one line: ``missing`` when it does not exist,
    ``unreadable (reason)`` when it cannot be read (a directory, no permission, not UTF-8)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(missing) from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else one_line(exc)
        raise error(f"{unreadable} ({reason})") from None


def read_model_file(path: Path, model: type[ModelT], missing: str) -> ModelT:
    """Validate a JSON artifact as ``model``, or fail with one line naming the file (exit 2).

    ``missing`` says what a missing file means for this artifact.
    """
    try:
        return model.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        raise InvalidInput(f"{path}: not found; {missing}") from None
    except ValidationError as exc:
        raise InvalidInput(format_validation_error(exc, str(path))) from None
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot read ({exc.strerror or exc})") from None


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write via a temp file in the same directory and rename, so readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """:func:`write_bytes_atomic` for UTF-8 text."""
    write_bytes_atomic(path, text.encode("utf-8"))


class JsonlWriter:
    """Append-only JSON lines, flushed per row so a crash keeps every finished step."""

    def __init__(self, path: Path):
        self.path = path
        self._handle = open(path, "a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self.write_many([row])

    def write_many(self, rows: Iterable[dict[str, Any]]) -> None:
        """The rows in one write and one flush: a step's rows, whole. A worker that the elastic agent stops while it
        salvages a step gets SIGTERM raised as an exception between two Python calls; between two rows' writes
        that kept a step with some ranks' rows only (seen once in CI)."""
        self._handle.write("".join(json.dumps(json_safe(row), separators=(",", ":")) + "\n" for row in rows))
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of a JSON-lines file; a torn last line (crash mid-write) is skipped, not fatal."""
    if not path.exists():
        return
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
