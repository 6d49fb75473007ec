"""Why a script exited with a non-zero status, in its own words.

A script that exits non-zero has usually said why on stderr first: argparse prints ``train.py: error: unrecognized
arguments: --lr`` and exits with status 2, a script checks its environment and calls ``sys.exit("no GPU")``. The
probe's error line said only "the script exited with status 2 after 0 of 60 optimizer steps", and the reason sat
in each rank's log. :class:`StderrTail` stands in for ``sys.stderr`` while the script runs and keeps the last line
written to it; :func:`exit_reason` puts that line, or the message ``sys.exit`` was given, after the status. The
last line is not always the reason (a warning, then a silent ``sys.exit(1)``), so the error says what it is.

>>> import io
>>> tail = StderrTail(io.StringIO())
>>> _ = tail.write("usage: train.py [-h] --model MODEL\\n"); _ = tail.write("train.py: error: the following arguments ")
>>> _ = tail.write("are required: --model\\n")
>>> print(exit_reason(2, tail.last_line, "after 0 of 60 optimizer steps").replace("; ", ";\\n"))
exited with status 2 after 0 of 60 optimizer steps;
the last line it wrote to stderr: train.py: error: the following arguments are required: --model
>>> exit_reason("no GPU on this node", tail.last_line, "after 0 of 60 optimizer steps")
'exited with status 1 after 0 of 60 optimizer steps: no GPU on this node'
>>> exit_reason(3, "", "after 2 of 60 optimizer steps")
'exited with status 3 after 2 of 60 optimizer steps'
>>> _ = tail.write("step 1\\r 10%|#  |\\r 20%|##  |"); tail.last_line
'20%|##  |'
"""

from __future__ import annotations

from typing import Any

#: The longest stderr line kept: the reason goes into a one-line error, not a log.
_KEPT = 400


class StderrTail:
    """A text stream that writes through to ``stream`` and remembers the last non-empty line written."""

    def __init__(self, stream: Any):
        self._stream = stream
        self._partial = ""
        self._last = ""

    def write(self, text: str) -> int:
        # Remember first: a stream closed under the script (its own redirection) still leaves the reason.
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()[-_KEPT:]
        for line in reversed(lines):
            if line.strip():
                self._last = line.strip()[-_KEPT:]
                break
        return self._stream.write(text)

    @property
    def last_line(self) -> str:
        """The last non-empty line, the unterminated one included (as a terminal shows it: after its last ``\\r``)."""
        return self._partial.rpartition("\r")[2].strip() or self._last

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, buffer ...
        return getattr(self._stream, name)


def exit_reason(code: Any, last_line: str, when: str) -> str:
    """``exited with status N`` ``when``, and why: ``sys.exit``'s message where it was given one, else stderr's last line."""
    if isinstance(code, str):  # sys.exit("message"): Python prints it and exits with status 1
        return f"exited with status 1 {when}: {code.strip()[-_KEPT:]}"
    said = f"; the last line it wrote to stderr: {last_line}" if last_line else ""
    return f"exited with status {code} {when}{said}"

