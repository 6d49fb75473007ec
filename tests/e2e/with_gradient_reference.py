"""The real ``healthcheck`` CLI, plus an independent record of every rank's local gradient (tests only).

    python -m tests.e2e.with_gradient_reference DUMP_DIR probe --script train.py ...

Before handing over to ``healthcheck.cli.main``, it wraps the script session so that every parameter
of the script's DDP model gets a tensor hook. Tensor hooks see each micro-batch's gradient of that
parameter on this rank, before DDP reduces anything; summed in float64 over the micro-batches of an
optimizer step they are the rank's true local gradient, computed without the monitor. At each step
boundary the vector is saved to ``DUMP_DIR/rank<r>-step<s>.pt``. The workers are forked from this
process, so they inherit the wrapper.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


def install(dump: Path) -> None:
    import torch

    from healthcheck.integrations.script.session import ScriptSession

    original_on_ddp = ScriptSession.on_ddp
    original_pre_step = ScriptSession._pre_step

    def on_ddp(self: Any, ddp: Any) -> None:
        original_on_ddp(self, ddp)
        parameters = [p for p in ddp.module.parameters() if p.requires_grad]
        self.reference_sizes = [p.numel() for p in parameters]
        self.reference = [None] * len(parameters)
        for index, parameter in enumerate(parameters):
            def keep(grad: Any, index: int = index) -> None:
                local = grad.detach().to(torch.float64).reshape(-1).cpu()
                self.reference[index] = local if self.reference[index] is None else self.reference[index] + local

            parameter.register_hook(keep)

    def pre_step(self: Any, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.model is not None and self._owns(optimizer) and self._depth == 0 and not self.complete:
            pieces = [r if r is not None else torch.zeros(n, dtype=torch.float64)
                      for r, n in zip(self.reference, self.reference_sizes, strict=True)]
            rank = int(os.environ["RANK"])
            torch.save(torch.cat(pieces), dump / f"rank{rank}-step{self.steps_done}.pt")
            self.reference = [None] * len(self.reference)
        original_pre_step(self, optimizer, args, kwargs)

    ScriptSession.on_ddp = on_ddp  # type: ignore[method-assign]
    ScriptSession._pre_step = pre_step  # type: ignore[method-assign]


if __name__ == "__main__":
    dump_dir = Path(sys.argv[1])
    dump_dir.mkdir(parents=True, exist_ok=True)
    install(dump_dir)
    from healthcheck.cli import run

    run(sys.argv[2:])
