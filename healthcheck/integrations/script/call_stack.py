"""The objects whose methods are on the call stack: what a hook learns about who called the script's step or forward
without patching them (the ``transformers.Trainer`` whose loop steps the optimizer, a ``torch.compile`` wrapper
calling the model).

>>> def hook():  # asks who called it
...     return next(callers(), None)
>>> class Loop:
...     def run(self):
...         return hook()
>>> isinstance(Loop().run(), Loop)
True
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, Iterator, Optional

#: Frames looked through: the loops and wrappers sought are a handful below the hooks that ask.
DEPTH = 64


def callers(depth: int = DEPTH) -> Iterator[Any]:
    """The ``self`` of each of the ``depth`` frames below the function that asks, innermost first (frames without
    one skipped). The frames are taken now, not as the iterator is read."""
    return _selves(sys._getframe(2), depth)


def _selves(frame: Optional[FrameType], depth: int) -> Iterator[Any]:
    for _ in range(depth):
        if frame is None:
            return
        candidate = frame.f_locals.get("self")
        if candidate is not None:
            yield candidate
        frame = frame.f_back
