"""The folded count sketch: layout, determinism, linearity, and an unbiased inner product (Monte Carlo)."""

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from healthcheck.measure import sketch as SK

# a tiny layout with many chunks, segments and partial segments: p = 31, m = 2, L = 62, G = 4, T = 248
K, M, CHUNK = 32, 2, 31 * 2 * 4


def _sk(x, seed, bucket_id=0, **kw):
    return SK.sketch_bucket(x, k=K, seed=seed, bucket_id=bucket_id, m=M, chunk=CHUNK, **kw)


def test_layout():
    lay = SK.get_layout(K, M, CHUNK)
    assert (lay.p, lay.m, lay.L, lay.G, lay.T) == (31, 2, 62, 4, 248)
    assert SK.sketch_dim(16384) == 16381 and SK.sketch_dim(4096) == 4093 and SK.sketch_dim(1024) == 1021


def test_safe_sketch_size():
    assert SK.safe_sketch_size(16384, [4096, 11008, 32000]) == 16381
    assert SK.safe_sketch_size(16384, [16381 * 2]) == 16369      # next prime down
    assert SK.safe_sketch_size(1024, [1021, 1019 * 3]) == 1013


def test_deterministic_and_bucket_dependent():
    x = torch.randn(5000)
    a, b = _sk(x, seed=3, bucket_id=7), _sk(x, seed=3, bucket_id=7)
    assert torch.equal(a, b)                       # bitwise identical: same seed + bucket
    assert not torch.equal(a, _sk(x, seed=3, bucket_id=8))
    assert not torch.equal(a, _sk(x, seed=4, bucket_id=7))
    # default (large) layout too
    y = torch.randn(3_000_001)
    assert torch.equal(SK.sketch_bucket(y, k=4096, seed=1, bucket_id=2), SK.sketch_bucket(y, k=4096, seed=1, bucket_id=2))


def test_structure_matches_documented_formula():
    """Each element lands in exactly one bin with sign +-1, given by the documented formula."""
    lay = SK.get_layout(K, M, CHUNK)
    n = 3 * lay.T + 77
    S = torch.stack([_sk(e, seed=11, bucket_id=5) for e in torch.eye(n)])      # [n, p]
    tau = SK.sign_table(11, lay.L, "cpu")
    assert tau.numel() == lay.L
    for i in range(n):
        c, t = divmod(i, lay.T)
        g, u = divmod(t, lay.L)
        key, a, b = SK._chunk_params(11, 5, c, lay.p)
        expect_bin = (u % lay.p + a * g + b) % lay.p
        expect_sign = (1 - 2 * SK.segment_sign_bits(key, g)) * float(tau[u])
        nz = S[i].nonzero().flatten().tolist()
        assert nz == [expect_bin], (i, nz, expect_bin)
        assert float(S[i, expect_bin]) == expect_sign
    # linearity
    x = torch.randn(n, dtype=torch.float64)
    assert torch.allclose(_sk(x, seed=11, bucket_id=5).double(), x @ S.double(), atol=1e-4)


def test_every_segment_of_a_chunk_reads_the_same_short_table():
    # The table is one segment long whatever the bucket: that is what keeps it in cache.
    for k in (1024, 4096, 16384):
        lay = SK.get_layout(k)
        assert lay.L <= 1 << 16 and lay.G == lay.p
        SK.sketch_bucket(torch.randn(3 * lay.L + 5), k=k, seed=9, bucket_id=0)
        assert SK.sign_table(9, lay.L, "cpu").numel() == lay.L


def test_piecewise_and_out_accumulation():
    x = torch.randn(20_011)
    full = _sk(x, seed=2, bucket_id=1)
    out = torch.zeros(SK.sketch_dim(K))
    cuts = [0, 5, 61, 62, 300, 9000, 20_011]
    for s, e in zip(cuts[:-1], cuts[1:]):
        _sk(x[s:e], seed=2, bucket_id=1, start=s, out=out)
    assert torch.allclose(out, full, atol=1e-4)


def test_host_and_gpu_paths_agree():
    """The host's numpy fold and row-by-row rotation compute what the GPU's fused fold and gather compute."""
    g = torch.Generator().manual_seed(4)
    for k in (32, 1024, 16384):
        lay = SK.get_layout(k)
        nb = 11
        xs = torch.randn(nb, lay.m, lay.p, generator=g)
        tau = SK.sign_table(5, lay.L, "cpu").view(lay.m, lay.p)
        rows, fused = torch.from_numpy(SK._fold_host(xs.numpy(), tau.numpy())), SK._fold_fused(xs, tau)
        assert torch.allclose(rows, fused, atol=1e-4), (rows - fused).abs().max()
        piece = SK.Piece(0, nb * lay.L, 0, nb, 3, *SK._chunk_params(5, 1, 0, lay.p))
        by_rows, by_gather = torch.zeros(2 * lay.p), torch.zeros(2 * lay.p)
        SK._rotate_rows_host(by_rows.numpy(), rows.numpy(), piece.moves(lay.p))
        SK._rotate_gather(by_gather, rows, piece)
        folded = by_rows[: lay.p] + by_rows[lay.p :]
        assert torch.allclose(folded, by_gather[: lay.p] + by_gather[lay.p :], atol=1e-3)


def test_half_precision_is_upcast():
    x = torch.randn(100_003).bfloat16()
    assert torch.equal(_sk(x, seed=1), _sk(x.float(), seed=1))
    x = torch.randn(100_003).half()
    assert torch.equal(_sk(x, seed=1), _sk(x.float(), seed=1))


def _mc(x, y, trials, bucket_id=0):
    est = torch.empty(trials, dtype=torch.float64)
    for s in range(trials):
        est[s] = _sk(x, seed=s, bucket_id=bucket_id).double() @ _sk(y, seed=s, bucket_id=bucket_id).double()
    return est


def test_unbiased_monte_carlo():
    """E<Sx,Sy> = <x,y>: Monte Carlo over seeds, on vectors with a large common (DC) component
    and power-of-two periodic structure (which would expose a biased sign/bin design)."""
    g = torch.Generator().manual_seed(0)
    n = 1500                                       # 6 chunks + a partial one
    i = torch.arange(n)
    x = (1.0 + 0.5 * torch.randn(n, generator=g) + 2.0 * (i % 64 == 3)).double()
    y = (1.0 + 0.5 * torch.randn(n, generator=g) + 2.0 * (i % 64 == 3)).double()
    trials = 3000
    est = _mc(x.float(), y.float(), trials)
    true = float(x @ y)
    se = float(est.std()) / math.sqrt(trials)
    assert abs(float(est.mean()) - true) < 4 * se, (float(est.mean()), true, se)
    # the variance is of count-sketch order (bound: (|x|^2|y|^2 + <x,y>^2)/p plus small terms)
    cs = (float(x @ x) * float(y @ y) + true ** 2) / 31
    assert float(est.var()) < 2.0 * cs, (float(est.var()), cs)


def test_unbiased_monte_carlo_norm():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(700, generator=g) + 3.0
    trials = 3000
    est = _mc(x, x, trials, bucket_id=4)
    true = float(x.double() @ x.double())
    se = float(est.std()) / math.sqrt(trials)
    assert abs(float(est.mean()) - true) < 4 * se


def test_no_state_leaks_between_calls():
    # Cached pieces (the sign table, the rows' rotations): a bigger bucket in between, and a bf16 one,
    # must not change what a bucket sketches to.
    g = torch.Generator().manual_seed(7)
    small, big = torch.randn(200_000, generator=g), torch.randn(1_500_000, generator=g)
    first = SK.sketch_bucket(small, k=1024, seed=3, bucket_id=0).clone()
    SK.sketch_bucket(big, k=1024, seed=3, bucket_id=1)
    SK.sketch_bucket(big.to(torch.bfloat16), k=1024, seed=3, bucket_id=2)
    assert torch.equal(SK.sketch_bucket(small, k=1024, seed=3, bucket_id=0), first)


def test_runs_bound_the_temporaries_without_changing_the_sketch(monkeypatch):
    # A fold call takes at most RUN_ELEMENTS: an FSDP group's gradient of gigabytes must not make a
    # gradient-sized signed copy. Cutting the body into runs changes no bin and no sign.
    x = torch.randn(5 * 248 + 17)
    whole = _sk(x, seed=6, bucket_id=3)
    monkeypatch.setattr(SK, "RUN_ELEMENTS", (62, 62))  # one segment (L = 62) per fold call
    assert torch.allclose(_sk(x, seed=6, bucket_id=3), whole, atol=1e-5)


def test_the_accelerator_path_sketches_what_the_host_path_does(monkeypatch):
    # A GPU takes other code (a fused fold in the gradient's dtype, cached rotations on the device, a
    # zero-padded partial segment) to launch few kernels; run here on the host, it must give the host's
    # sketch: ranks on different device types compare sketches. Heads, tails, chunk crossings, a start
    # offset, runs of a few rows (rotated row by row) and of many (one gather), fp32 and bf16.
    def sketch(x, start):  # p = 31, m = 2, L = 62, G = 16 segments a chunk
        return SK.sketch_bucket(x, k=K, seed=8, bucket_id=2, m=M, chunk=62 * 16, start=start)

    g = torch.Generator().manual_seed(11)
    cases = [(torch.randn(40 * 62 + 17, generator=g), 0), (torch.randn(30 * 62 + 40, generator=g), 23)]
    cases.append((torch.randn(35 * 62 + 5, generator=g).bfloat16(), 7))
    host = [sketch(x, start) for x, start in cases]
    monkeypatch.setattr(SK, "_host_path", lambda device: False)
    for rows in (4, 16):
        monkeypatch.setattr(SK, "RUN_ELEMENTS", (62 * rows, 62))
        for (x, start), expected in zip(cases, host):
            assert torch.allclose(sketch(x, start), expected, atol=1e-5)
    monkeypatch.setattr(SK, "RUN_ELEMENTS", (1 << 24, 1 << 20))
    big = torch.randn(3_000_003, generator=g).bfloat16()  # the default layout: p = 4093, m = 16, 45 rows gathered
    expected = SK.sketch_bucket(big, k=4096, seed=1, bucket_id=5)
    monkeypatch.setattr(SK, "_host_path", lambda device: True)
    assert torch.allclose(SK.sketch_bucket(big, k=4096, seed=1, bucket_id=5), expected, atol=1e-3)


@given(key=st.integers(0, 2**64 - 1), a=st.integers(0, 4092), b=st.integers(0, 4092), g0=st.integers(0, 4000),
       nb=st.integers(1, 90))
def test_the_rows_hashed_as_arrays_are_the_rows_hashed_one_by_one(key, a, b, g0, nb):
    # The array hash (FSDP2's per-step salt asks for new rows every step) must give the bits the scalar one gives.
    p = 4093
    one_by_one = [((a * g + b) % p, -1.0 if SK.segment_sign_bits(key, g) else 1.0) for g in range(g0, g0 + nb)]
    r, eps = SK.row_moves_arrays(key, a, b, g0, nb, p)
    assert list(zip(r.tolist(), eps.tolist())) == one_by_one
    SK._row_moves.cache_clear()
    assert list(SK._row_moves(key, a, b, g0, nb, p)) == one_by_one  # either side of the array threshold
