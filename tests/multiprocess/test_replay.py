"""The replay audit on real gloo ranks: it leaves training bit for bit unchanged, and it names a bad device.

Four ranks fine-tune the probe's tiny GPT-2 under DDP with the trainer's own step. Three runs from the same
seed: without replay, with a replay every 2 steps, and with a replay every 2 steps while rank 2's matmuls
are off by 1e-3 from step 2 (the ``bad-device`` fault). The first two must end with bit-identical
parameters, losses and RNG state; the third must name rank 2, and only from step 2.

    python -m pytest tests/multiprocess/test_replay.py -q
"""

from __future__ import annotations

import hashlib
import pickle
import random

import numpy as np
import pytest
import torch

from healthcheck.artifacts import RankInfo
from healthcheck.config import load_config, resolve_for_rank
from healthcheck.measure import distributed
from healthcheck.run import launcher
from healthcheck.run.data import MicroBatches, prepare_samples, shard_plan
from healthcheck.run.faults import install_faults
from healthcheck.run.modeling import build_model, load_tokenizer
from healthcheck.run.sharding import wrap_model
from healthcheck.run.trainer import apply_update, backward_over_micro_batches
from healthcheck.run.worker import lr_lambda, replay_rounds, seed_everything

pytestmark = pytest.mark.multiprocess

WORLD = 4
FAULTY = 2
STEPS = 5


def _digest(*arrays: bytes) -> str:
    h = hashlib.sha256()
    for data in arrays:
        h.update(data)
    return h.hexdigest()[:16]


def _train(replay_every: int, fault: bool) -> dict:
    rank = distributed.rank()
    sets = [f"distributed.nproc={WORLD}", f"train.steps={STEPS}", f"metrics.replay_every={replay_every}"]
    if fault:
        sets.append(f"rank_overrides={{{FAULTY}: {{faults: {{matmul_error: 0.001, matmul_error_from_step: 2}}}}}}")
    config = load_config(None, sets)
    rank_config = resolve_for_rank(config, rank)
    seed_everything(rank_config.train.seed)
    device = torch.device("cpu")
    tokenizer = load_tokenizer(rank_config.model)
    samples = prepare_samples(rank_config.data, tokenizer, cache_key=rank_config.model.name)
    model = build_model(rank_config.model, len(tokenizer), rank_config.data.max_length)
    ddp = wrap_model(model, config.distributed, device, WORLD)
    marker: dict = {"step": None}
    install_faults(model, rank_config.faults, marker)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=rank_config.train.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(rank_config.train.lr_warmup_steps))
    batches = MicroBatches(samples, shard_plan(rank_config.data, rank_config.train, rank, WORLD), rank_config.train,
                           tokenizer.pad_token_id)
    ranks = [RankInfo(rank=r, local_rank=r, node="n", device="cpu", device_name="cpu", precision="fp32") for r in range(WORLD)]
    rounds = replay_rounds(config, rank_config, model, device, ranks)
    assert (rounds is None) == (replay_every == 0)
    losses = []
    for step in range(STEPS):
        marker["step"] = step
        micro = [batches.next()]
        if rounds is not None and rounds.due(step):
            rounds.check(step, micro[0])
        loss, _ = backward_over_micro_batches(ddp, micro, device, precision="fp32")
        apply_update(ddp, optimizer, scheduler, max_grad_norm=rank_config.train.max_grad_norm)
        losses.append(float(loss).hex())
    params = _digest(*(p.detach().contiguous().view(torch.uint8).numpy().tobytes() for p in model.parameters()))
    rng = _digest(torch.get_rng_state().numpy().tobytes(), pickle.dumps(random.getstate()), np.random.get_state()[1].tobytes())
    return {"params": params, "losses": losses, "rng": rng, "evidence": rounds.evidence if rounds is not None else None}


def _check_replay_leaves_training_unchanged() -> None:
    plain = _train(0, fault=False)
    replayed = _train(2, fault=False)
    for key in ("params", "losses", "rng"):
        assert replayed[key] == plain[key], (key, distributed.rank())
    evidence = replayed["evidence"]
    assert evidence.mode == "bitwise" and [r.step for r in evidence.rounds] == [0, 2, 4]
    assert all(r.groups == [list(range(WORLD))] and r.params_agree and not r.differences for r in evidence.rounds)
    # The replayed micro-batch comes from more than one rank over the probe (a hash of the step).
    assert len({r.source_rank for r in evidence.rounds}) > 1


def _check_bad_device_is_named() -> None:
    evidence = _train(2, fault=True)["evidence"]
    first, *faulted = evidence.rounds
    assert first.step == 0 and not first.differences, first
    for round_ in faulted:
        assert round_.params_agree and [d.rank for d in round_.differences] == [FAULTY], round_
        difference = round_.differences[0]
        assert difference.reference_rank != FAULTY and difference.reproduced
        assert 1e-4 < difference.rel_l2 < 1e-2 and difference.max_abs > 0, difference
        assert round_.groups == [[r for r in range(WORLD) if r != FAULTY], [FAULTY]]


def _worker() -> None:
    distributed.set_worker_threads(WORLD)
    distributed.init_distributed("cpu", "gloo", 120)
    try:
        _check_replay_leaves_training_unchanged()
        _check_bad_device_is_named()
    finally:
        distributed.destroy_distributed()


def test_replay_is_invisible_to_training_and_names_a_bad_device():
    launcher.launch_local(_worker, WORLD, run_id="test-replay-4")
