"""busy_ms names the rank that is slow, wherever in its step it is slow (measure/wait_clock.py).

Four gloo ranks train a small DDP model that has a registered buffer, so DDP's forward broadcasts it from
rank 0 every step. One rank sleeps between its backward and ``end_step`` (a rank that saves or logs
synchronously). The others wait for it either in the next forward's broadcast or, where the loop all-reduces
its loss "for logging" after ``end_step`` (inside ``monitor.waiting()``, as script mode does for a script's
collectives), there. Before the wait clock, the rank that waited for it in the broadcast was named instead:
busy_ms started at ``end_step`` and counted the waits inside the step.

The test judges blame, not the audit's tolerance: with ``factor=1.5`` a rank is named only where it carries most of
another rank's 150 ms pause a step. The slow rank reads ~5.5x its ~33 ms of own work standalone; in a full suite on
this host its own work once took ~68 ms, where a 100 ms pause read 2.56x and fell under an earlier 2x factor in 2 of
20 steps. A rank that absorbed the pause read 5.2x before the wait clock (and the slow rank of the logging case ~1x).
Clean ranks here read 0.94-1.17x. The rank that waited in the broadcast computes after the pause, beside the slow
rank, and in the 1.17x run (19 of 20 steps, once in a fresh-clone suite) both took ~38 ms of own work where the two
ranks that computed before the pause took ~34: most likely the wake-up cost (cold cache; on a VM, an idle vCPU) and
the ring all-reduce of every rank's buckets sharing the 2 cores with them, neither of which busy_ms can take out.
With an earlier ~2 ms step the waiting rank read 1.52x on CI's host. Both are above the default 1.035x, which is for
real probes, whose clean false-alarm rate the detection matrix states (README, Measured figures).
"""

from __future__ import annotations

import time

import pytest
import torch

from healthcheck.judge.rank_outliers import straggler_audit
from healthcheck.measure import distributed, runqueue
from healthcheck.measure.monitor import WorkerConsistencyMonitor
from healthcheck.run import launcher

WORLD = 4
STEPS = 22
PAUSE_S = 0.15
FEATURES, HIDDEN, BATCH = 256, 1024, 1024


class _WithBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, FEATURES))
        self.register_buffer("scale", torch.ones(FEATURES))  # DDP broadcasts it in every forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


def _worker(slow_rank: int, log_loss: bool) -> dict[int, list[float]] | None:
    from torch.nn.parallel import DistributedDataParallel

    distributed.set_worker_threads(WORLD)
    distributed.init_distributed("cpu", "gloo", 120)
    try:
        rank = distributed.rank()
        torch.manual_seed(0)
        ddp = DistributedDataParallel(_WithBuffer(), bucket_cap_mb=0.05)
        assert ddp.will_sync_module_buffers(), "the scenario needs DDP's buffer broadcast"
        monitor = WorkerConsistencyMonitor(ddp, direction="sketch")
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(rank)
        busy: dict[int, list[float]] = {}

        def keep(metrics) -> None:
            if metrics is not None and "busy_ms" in metrics.per_rank_extras:
                busy[metrics.step] = list(metrics.per_rank_extras["busy_ms"])

        for _ in range(STEPS):
            x = torch.randn(BATCH, FEATURES, generator=generator)
            loss = ddp(x).square().mean()
            loss.backward()
            if rank == slow_rank:
                time.sleep(PAUSE_S)
            keep(monitor.end_step(loss.detach()))
            if log_loss:
                logged = loss.detach().clone()
                with monitor.waiting():
                    torch.distributed.all_reduce(logged)
            optimizer.step()
            optimizer.zero_grad()
        keep(monitor.flush())
        monitor.close()
        assert "_sync_buffers" not in ddp.__dict__, "close() left DDP's buffer broadcast wrapped"
        return busy if rank == 0 else None
    finally:
        distributed.destroy_distributed()


@pytest.mark.multiprocess
@pytest.mark.parametrize(("slow_rank", "log_loss"), [(3, False), (1, True)])
def test_a_rank_slow_after_its_backward_is_the_one_named(slow_rank, log_loss):
    if runqueue.read() is None and runqueue.cores_shared(WORLD):
        pytest.skip("ranks share this host's cores and it gives no run-queue clock: busy_ms keeps the waits for a core")
    busy = launcher.launch_local(_worker, WORLD, (slow_rank, log_loss), run_id=f"test-busy-{slow_rank}")[0]
    outcome = straggler_audit(busy, factor=1.5, max_p=1e-4)
    assert outcome.ranks == (slow_rank,), (outcome.message, busy)
