"""``benchmarks/grad_sketch.py``'s ``LocalGradients`` on 2 gloo ranks: the claim the no-comm-hook design rests on,
that a callback queued at the start of the backward reads each rank's own gradient before DDP's finalize averages
it, and that one queued from it runs after the finalize (the kernel runs in Triton's interpreter).

    python -m pytest tests/multiprocess/test_grad_sketch_probe.py -q
"""

from __future__ import annotations

import textwrap

import pytest

from tests.benchmark_scripts import BENCHMARKS
from tests.unit.benchmarks.test_grad_sketch import run_interpreted

ORDER = textwrap.dedent(
    f"""
    import contextlib, copy, sys, torch
    sys.path.insert(0, {str(BENCHMARKS)!r})
    from grad_sketch import LocalGradients
    from healthcheck.measure import distributed
    from healthcheck.measure.sketch import sketch_bucket
    from healthcheck.run import launcher

    def worker():
        from torch.nn.parallel import DistributedDataParallel
        distributed.set_worker_threads(2)
        distributed.init_distributed("cpu", "gloo", 120)
        try:
            rank = distributed.rank()
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
            plain = copy.deepcopy(model)
            ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)  # several buckets
            probe = LocalGradients(ddp, k=1021, seed=5, kernel=True)
            for step in range(3):
                local = [torch.zeros_like(p) for p in plain.parameters()]
                for micro in range(2):  # accumulation: the first backward under no_sync is not sketched
                    g = torch.Generator().manual_seed(100 * step + 10 * rank + micro)
                    x, y = torch.randn(5, 16, generator=g) * (1 + rank), torch.randn(5, 4, generator=g)
                    with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                        loss = ((ddp(x) - y) ** 2).mean()
                        probe.arm(loss)
                        probe.result = None
                        loss.backward()
                    assert (probe.result is None) == (micro == 0), (step, micro)
                    grads = torch.autograd.grad(((plain(x) - y) ** 2).mean(), list(plain.parameters()))
                    local = [a + b for a, b in zip(local, grads)]
                got, squares = probe.result
                want = sum(sketch_bucket(g, k=1021, seed=5, bucket_id=i) for i, g in enumerate(local))
                # This rank's own gradient, not the average DDP puts in .grad at its finalize.
                assert float((got - want).abs().max()) <= 1e-5 * float(want.norm()), (rank, step)
                mine = sum(float(g.double().square().sum()) for g in local)
                assert abs(float(squares.sum()) - mine) <= 1e-5 * mine, (rank, step)
                flat = torch.cat([g.reshape(-1) for g in local]).double()
                mean_sq = float(distributed.all_gather_rows(flat).mean(0).square().sum())  # after DDP's finalize
                assert abs(float(probe.mean_sqnorm) - mean_sq) <= 1e-4 * mean_sq, (float(probe.mean_sqnorm), mean_sq)
                assert abs(mine - mean_sq) > 1e-3 * mean_sq  # the ranks' gradients differ: the check means something
                for p in ddp.parameters():
                    p.grad = None
        finally:
            distributed.destroy_distributed()

    launcher.launch_local(worker, 2, run_id="test-grad-sketch")
    print("ok")
    """
)



@pytest.mark.multiprocess
def test_a_callback_queued_at_the_start_of_the_backward_reads_the_local_gradients():
    pytest.importorskip("triton")
    run_interpreted(ORDER)
