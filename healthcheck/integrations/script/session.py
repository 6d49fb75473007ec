"""A probe of an unmodified training script: its optimizer steps become the probe's steps.

On every worker, before the script runs, :class:`ScriptSession` installs its patches (:mod:`.patches`) and two
global optimizer hooks. Then, with nothing imported from healthcheck:

* every ``DistributedDataParallel`` the script builds gets the :class:`WorkerConsistencyMonitor`, the loss capture
  (:mod:`healthcheck.integrations.loss_capture`) and the audits' recorder. A model sharded with FSDP2 (``fully_shard``
  on blocks, then on the root) gets the same: the outermost sharded module is the root, the loss capture watches it
  from when it is sharded, and the monitor takes its reduce-scatters at its first training forward (when every
  ``fully_shard`` call has been made);
* until the first update the ranks compare where they are at every place they must meet (:mod:`.lockstep`);
* an optimizer step that updates the monitored model's parameters is a probe step (other optimizers stepping before
  the next backward join it: :mod:`.updates`). Before it runs (after the synchronising backward) the monitor gathers
  the step's metrics; after it, parameter hashes are compared on check steps;
* at the first step, what every rank trains with (seeds and RNG at the first training forward, the environment, its
  loss and clipping settings, the first step's DataLoader indices) is gathered and judged at once, and so are the
  parameter hashes on check steps: with fail fast, a decisive failure ends the probe there;
* after ``train.steps`` steps (or a non-finite step, or a decisive failure) every rank gathers its evidence, then
  :class:`ProbeComplete` unwinds the script from inside ``optimizer.step()``: at the same step on every rank, before
  any saving or evaluation that follows the loop.

The run layer supplies heartbeats, faults and row writing through :class:`SessionHooks`.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, ContextManager, Optional

from healthcheck.artifacts import FailFastPolicy, RankEvidence, RankInfo, ReplayEvidence, WorkerReport
from healthcheck.config import ProbeConfig
from healthcheck.errors import InvalidInput
from healthcheck.integrations.loss_capture import LossCapture
from healthcheck.integrations.script import ddp_agreement, observe, refusals
from healthcheck.integrations.script.clipping import ClipRecorder, grad_ids
from healthcheck.integrations.script.closures import ClosureSteps
from healthcheck.integrations.script.forwards import TrainingForwards
from healthcheck.integrations.script.grad_start import GradientStart
from healthcheck.integrations.script.loaders import LoaderRecorder
from healthcheck.integrations.script.lockstep import LOCKSTEP, Lockstep
from healthcheck.integrations.script.monitor_start import make_monitor
from healthcheck.integrations.script.patches import install
from healthcheck.integrations.script.replay_batch import BatchKeeper, model_loss, unavailable
from healthcheck.integrations.script.scaler_skips import PendingSkip, overflowed_in_part, persistent_overflow
from healthcheck.integrations.script.seeds import SeedCalls
from healthcheck.integrations.script.session_hooks import ProbeComplete, SessionHooks
from healthcheck.integrations.script.sharded_root import ShardedRoot
from healthcheck.integrations.script.step_facts import ScaleRecorder, step_facts
from healthcheck.integrations.script.updates import UpdateSteps
from healthcheck.judge.assemble import environment_from_evidence, parameter_outcomes, script_shard_audit, seeds_from_evidence
from healthcheck.judge.audit_outcome import AuditOutcome
from healthcheck.judge.fail_fast import FailFast, StepAudits
from healthcheck.measure import distributed as hdist
from healthcheck.measure.evidence import AuditRecorder
from healthcheck.measure.loss_scale import unscaled
from healthcheck.measure.step_gather import CLOSE_WAIT_S


class ScriptSession:
    """Measures one script run on this rank; see the module docstring. Use as a context manager."""

    def __init__(self, config: ProbeConfig, hooks: SessionHooks, started_at: float, fail_fast: Optional[FailFastPolicy] = None):
        self.config, self.hooks, self.started_at = config, hooks, started_at
        self.fail_fast = FailFast(fail_fast)
        self.capture = LossCapture()
        self.clips = ClipRecorder(lambda: self._param_ids, lambda: grad_ids(self.model))
        self.scales = ScaleRecorder()  #: which GradScaler steps which optimizer, and its skips (fp16 mixed precision)
        self.loaders = LoaderRecorder()
        self.model: Any = None  #: the DDP wrapper, or the FSDP2 root
        self.monitor: Any = None
        self.lockstep = Lockstep(lambda outcome: self._stop_at_start(self.model if self.model is not None else self.fsdp.root, outcome))
        self.fsdp = ShardedRoot(self.capture.watch, self._start_sharded, self._stop_at_start, self.lockstep)
        self._keeper: Optional[BatchKeeper] = None  #: the first training forward's inputs, per step
        self._replay: Any = None  #: the replay audit's rounds (run layer), once the first step shows they can run
        self.audit: Optional[AuditRecorder] = None
        self.steps_done, self.complete = 0, False
        self.report: Optional[WorkerReport] = None
        self.seeds = SeedCalls()  #: what the script seeds python's and numpy's generators with (:mod:`.seeds`)
        self.forwards = TrainingForwards(self._first_forward_facts, lambda: self.lockstep.reducing)  # model.module(...): none
        self.updates = UpdateSteps(lambda: self.forwards.backwards)  #: several optimizers, one update (:mod:`.updates`)
        self.skip = PendingSkip(self._skipped_whole)  #: a GradScaler's skip, whole or in part (:mod:`.scaler_skips`)
        self._param_ids: set[int] = set()
        self._registering, self._depth, self._joined = False, 0, 0
        self._loss_problem: Optional[str] = None
        self._all_ranks: list[RankInfo] = []
        self._first_step_at = self._train_started = 0.0
        self._last_post = time.perf_counter()
        self._step_audits = StepAudits()
        self._grad_start: Optional[GradientStart] = None  #: were the gradients cleared before each step's backward
        self._handles: list[Any] = []
        self._patches: Any = None

    def _first_forward_facts(self, module: Any) -> dict[str, Any]:
        return {**observe.first_forward_facts(module), **self.seeds.fields()}  # the seeds as of when the states are read

    # ------------------------------------------------------------------ install / remove

    def __enter__(self) -> ScriptSession:
        self._patches = install(self)
        self.capture.__enter__()
        self._handles = ClosureSteps(self._pre_step, self._post_step).register()  # step(closure): :mod:`.closures`
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self.capture.close()
        if self._patches is not None:
            self._patches.restore()
        if self.monitor is not None:
            if exc_info[0] is not None and not self.complete:
                self._salvage()
            self.monitor.close()

    def _salvage(self) -> None:
        """The script failed: keep the last completed step's rows if its gather finishes within a bounded wait."""
        with contextlib.suppress(Exception):  # the gather failed with its peer: nothing to keep
            metrics = self.monitor.flush(timeout_s=CLOSE_WAIT_S)
            if metrics is not None:
                self.hooks.on_metrics(metrics.step, metrics)

    # ------------------------------------------------------------------ callbacks from the patches

    def before_ddp(self, init: Any, args: tuple, kwargs: dict) -> None:
        """``DistributedDataParallel(...)`` is about to broadcast the weights: first, the arguments that decide how."""
        if self.model is None and self.fsdp.root is None and (differs := ddp_agreement.constructor_disagreement(init, args, kwargs)):
            self._stop_at_start(*differs)

    def on_ddp(self, ddp: Any) -> None:
        if self.model is not None or self.fsdp.root is not None:
            raise InvalidInput("the script builds a second data-parallel model; a probe measures one trained model")
        # The monitor is made at the first forward: a script registers its comm hook after wrapping (accelerate does).
        self._ddp_start = ddp.register_forward_pre_hook(self._start_ddp)
        self._handles += [self._ddp_start, *self.lockstep.attach_ddp(ddp)]
        self.model = ddp
        self._param_ids = {id(p) for p in ddp.parameters()}
        self.capture.watch(ddp.module)
        self._grad_start = GradientStart(ddp)
        self._handles += self.forwards.attach(ddp.module) + self._grad_start.attach(ddp.module) + [self.skip.attach(ddp.module)]
        self._keeper = BatchKeeper(ddp.module)
        self.audit = AuditRecorder(ddp.module, param_check_every=self.config.metrics.param_check_every)
        self.hooks.install_faults(ddp.module)

    def _start_ddp(self, ddp: Any, args: Any) -> None:
        """The DDP model's first forward: where the ranks are, whether they reduce alike, then its monitor (:mod:`.monitor_start`)."""
        self._ddp_start.remove()  # its one call: the later forwards run without it
        self.lockstep.first_forward()  # the others may be at a collective of the script's
        if not (outcome := ddp_agreement.check_agreement(ddp)).passed:  # the same on every rank
            self._stop_at_start(ddp, outcome)
        self._registering = True
        try:
            self.monitor = make_monitor(self.config, ddp)
        finally:
            self._registering = False

    def before_fully_shard(self, module: Any) -> None:
        """``fully_shard(module)`` is about to run (see :class:`.ShardedRoot`)."""
        self.fsdp.before(module)

    def on_fully_shard(self, module: Any) -> None:
        """``fully_shard(module)`` ran: one more candidate for the trained root, unless training started."""
        if self.model is not None:
            if self.fsdp.root is None:
                raise InvalidInput("the script shards a module with fully_shard after wrapping a model in DDP; a probe measures one")
            raise InvalidInput("the script calls fully_shard after training started; a probe measures one sharded model")
        self.fsdp.add(module)

    def _start_sharded(self, module: Any, args: Any, kwargs: dict) -> None:
        """The FSDP2 root's first training forward: FSDP2's own pre-forward hook (prepended) has run its lazy
        init, so every parameter group exists."""
        if self.config.faults.grad_noise_std > 0:
            raise InvalidInput(
                "faults.grad_noise_std cannot be injected into an FSDP2 model (parameter hooks never see its local gradient)"
            )
        self.monitor = make_monitor(self.config, module)
        self.model = module
        self._param_ids = {id(p) for p in module.parameters()}
        every = self.config.metrics.param_check_every
        self.audit = AuditRecorder(module, param_check_every=every, sharded=True, pre_shard=self.fsdp.pre_shard)
        # The root's forwards, counted as DDP's are. This one's pre-hooks are already running; its forward hooks,
        # read after the forward, include the one added here.
        self._grad_start = GradientStart(module)
        self._handles += self.forwards.attach(module) + self._grad_start.attach(module) + [self.skip.attach(module)]
        self.forwards.before(module, args, kwargs)
        self._keeper = BatchKeeper(module)
        self._keeper.keep(module, args, kwargs)  # this forward's pre-hooks were listed before the keeper's was added
        self.hooks.install_faults(module)

    def _stop_at_start(self, module: Any, outcome: AuditOutcome, compared: Optional[dict[str, str]] = None) -> None:
        """The ranks cannot train together: FSDP2 ranks shard differently (:mod:`.shard_agreement`), or ranks are not at
        the same place before the first update (:mod:`.lockstep`), or set DDP otherwise (:mod:`.ddp_agreement`; before its
        constructor, ``compared``). Every rank ends the probe there, at step 0, the environment audit failing on them."""
        facts = self.forwards.facts or self._first_forward_facts(module)
        self.model = module
        if self.audit is None:
            self.audit = AuditRecorder(
                module,
                param_check_every=self.config.metrics.param_check_every,
                # Not the modules' mode: a rank stopped before its first training forward may not have set it yet.
                extra={"model_dtype": facts["model_dtype"], **{k: v for k, v in facts["module"].items() if k != "model.eval_modules"},
                       **ddp_agreement.agreement_facts(module), **(compared or {})},
            )
            self.audit.rng["rng_start"] = facts["rng"]
        if self.lockstep.fact is not None:
            self.audit.extra[LOCKSTEP] = self.lockstep.fact
        loader = self.loaders.training_loader()
        info, _ = observe.rank_info(facts, loader.plan if loader else None, self.monitor)
        self._all_ranks = [RankInfo.model_validate(item) for item in hdist.all_gather_objects(info.model_dump())]
        self._first_step_at, self._train_started = time.time(), time.perf_counter()
        self.fail_fast.cannot_continue(0, "environment", outcome.message, outcome.ranks)
        self._finish()
        raise ProbeComplete()

    def waiting(self) -> ContextManager[None]:
        """Around a collective the script (or an audit) runs: its time is waiting on the others, not busy_ms."""
        return self.monitor.waiting() if self.monitor is not None else contextlib.nullcontext()

    def owns_comm_hook(self, ddp: Any) -> bool:
        """True when a comm hook registration on ``ddp`` would take the monitor's slot (it reads DDP's buckets)."""
        monitor = self.monitor
        return ddp is self.model and not self._registering and monitor is not None and monitor.gradient_source == "comm_hook"

    def on_process_group(self) -> None:
        self.hooks.on_process_group()

    # ------------------------------------------------------------------ the step boundary

    def _owns(self, optimizer: Any) -> bool:
        return any(id(p) in self._param_ids for group in optimizer.param_groups for p in group["params"])

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.complete:
            raise ProbeComplete()
        if self.model is None:
            raise refusals.refuse_no_model()
        if not self._owns(optimizer) or self.scales.overflowed(optimizer):  # a GradScaler's skip, inside the optimizer
            return
        if self.monitor is None:
            raise refusals.refuse_step_before_forward()
        if self._joined or self._depth == 0 and self.updates.joins(optimizer):  # another optimizer of this update
            self._joined += 1
            self.scales.stepped(optimizer)
            return
        self._depth += 1
        if self._depth > 1:  # an optimizer whose step() calls its base class's: one step, not two
            return
        self.skip.cancel()  # the scaler skipped another optimizer on these gradients: this update is under way
        step = self.steps_done
        self.hooks.beat(step, "sync")
        if self._keeper is not None:  # before the start's gather: a script reading no DataLoader is judged at step 0
            self.loaders.on_step_inputs(step, self._keeper.batch)
        if step == 0:
            self.lockstep.first_update()  # collective: a rank that is not at this step stops every rank
            self._start(optimizer)
            if self.fail_fast.stop is not None:  # decided before the first update: no parameter moves
                self._depth -= 1
                self._finish()
                raise ProbeComplete()
        self.hooks.at_step_start(step)
        # Until the end of backward, all-reduce included (so the wait for the slowest rank too; the
        # stragglers audit uses the monitor's busy_ms, which excludes it).
        extras: dict[str, Optional[float]] = {"compute_ms": (time.perf_counter() - self._last_post) * 1000}
        step_loss = self.capture.take()
        extras["loss_weight"] = step_loss.weight  # the loss's weight in this rank's backward (judge/loss_weight.py)
        extras["loss_weight_u"] = step_loss.weight_rounding  # and the rounding it was read to
        if step_loss.loss is None and self._loss_problem is None:
            self._loss_problem = f"step {step}: {step_loss.reason}"
        extras.update(step_facts(optimizer, self.model, self.scales))  # lr, grad_scale, comm_hook_exact: every rank's
        extras["grads_carried"] = self._grad_start.take() if self._grad_start is not None else None
        self._record(self.monitor.end_step(step_loss.loss, tokens=step_loss.tokens, extras=extras))
        if self._replay is not None and self._replay.due(step):
            self._replay_round(step)
        self.hooks.beat(step, "optimizer")

    def _record(self, metrics: Any) -> None:
        """A step's metrics (they arrive a step late): rows on rank 0, and a stop on a non-finite value."""
        if metrics is None:
            return
        metrics = unscaled(metrics)  # a GradScaler's scale, common to every rank, out of the norms (measure/loss_scale.py)
        if overflowed_in_part(metrics):  # every rank's scaler skipped an optimizer of it: nothing measured (:mod:`.scaler_skips`)
            assert self.audit is not None
            self.audit.scaler_overflows.append((metrics.step, metrics.nonfinite_ranks))
            return
        self.hooks.on_metrics(metrics.step, metrics)
        # Every rank sees the same gathered metrics, so all stop after the same step.
        self.fail_fast.nonfinite(metrics.step, metrics.nonfinite_ranks)
        if self.fail_fast.policy.enabled:  # the exact audits of the steps' gathered values (loss weight, stale gradients)
            self.fail_fast.judge(metrics.step, self._step_audits.add(metrics.step, metrics.per_rank_extras, metrics.per_rank_tokens))

    def on_scaler_step(self, optimizer: Any) -> None:
        """A ``GradScaler.step`` returned. Where it skipped the first optimizer of an update (an inf or NaN gradient),
        the update is skipped whole unless another optimizer steps before the next forward (:mod:`.scaler_skips`)."""
        if self.scales.skipped(optimizer) and self.monitor is not None and self._owns(optimizer) and not self.updates.under_way():
            self.skip.arm()

    def _skipped_whole(self, skipped_at: float) -> None:
        """That backward was no probe step: what the monitor, the loss capture and the forward counts took from it goes."""
        self.scales.skips += 1
        overflow = persistent_overflow(self.scales.skips, self.steps_done, self.monitor.discard_step())
        self.forwards.restart()
        self.capture.take()
        if self._keeper is not None:
            self._keeper.reset()
        self._last_post = skipped_at
        if overflow is not None:  # every later update would be skipped too (:mod:`.scaler_skips`)
            self.fail_fast.cannot_continue(self.steps_done, "nonfinite", *overflow)
            self._finish()
            raise ProbeComplete()

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.model is None or not self._owns(optimizer) or self.scales.overflowed(optimizer):
            return
        if self._joined:
            self._joined -= 1
            return
        self._depth -= 1
        if self._depth > 0:
            return
        self.updates.settle()
        assert self.audit is not None
        step = self.steps_done
        self.audit.after_optimizer_step(step, optimizer)  # collective on parameter-check steps (FSDP2: its settings)
        if self.audit.checked_at(step):  # every rank holds the same hash table: the same decision
            self.fail_fast.judge(
                step,
                parameter_outcomes(
                    self.audit.param_checks, self.audit.param_names(), self.audit.param_drift, self.audit.sharded_evidence()
                ),
            )
        self.steps_done += 1
        self.loaders.steps = self.steps_done
        if self._keeper is not None:
            self._keeper.reset()
        if self._grad_start is not None:
            self._grad_start.armed_after_step()
        if self.steps_done >= self.config.train.steps or self.fail_fast.stop is not None:
            self._finish()
            raise ProbeComplete()
        self.hooks.after_step(step)
        self._last_post = time.perf_counter()
        self.hooks.beat(self.steps_done, "compute")

    # ------------------------------------------------------------------ start and finish

    def _start(self, optimizer: Any) -> None:
        """At the first step: what every rank trains with, gathered once (a collective)."""
        assert self.audit is not None
        facts = self.forwards.stop()
        loader = self.loaders.training_loader()
        start = observe.start_facts(facts, optimizer, self.model, loader, self.forwards.count)
        start.update({**self.forwards.reduction_facts(self.model), **self.forwards.other_model_facts()})
        self.audit.extra.update({**start, **self.capture.loss_settings(), **self.clips.facts()})
        if "rng" in facts:
            self.audit.rng["rng_start"] = facts["rng"]
        self.audit.hints = dict(facts.get("hooks", {}))
        rank_info, device = observe.rank_info(facts, loader.plan if loader else None, self.monitor)
        # What the first step already shows rides on the same gather: RNG states, extras, the DataLoader's batches.
        early = RankEvidence(rng=self.audit.rng, extra=self.audit.extra, **self.loaders.evidence())
        keeper = self._keeper
        replay_problem = unavailable(keeper.batch, keeper.redirected) if keeper is not None else None
        gathered = hdist.all_gather_objects({"info": rank_info.model_dump(), "evidence": early.model_dump(), "replay": replay_problem})
        self._all_ranks = [RankInfo.model_validate(item["info"]) for item in gathered]
        self._start_replay(device, next((item["replay"] for item in gathered if item["replay"]), None))
        if self.fail_fast.policy.enabled:
            per_rank = [RankEvidence.model_validate(item["evidence"]) for item in gathered]
            audits = {"data_shards": script_shard_audit(per_rank), "seeds": seeds_from_evidence(self._all_ranks, per_rank, script=True),
                      "environment": environment_from_evidence(self._all_ranks, per_rank)}
            self.fail_fast.judge(0, audits)
        self._first_step_at, self._train_started = time.time(), time.perf_counter()

    def _start_replay(self, device: Any, problem: Optional[str]) -> None:
        """The replay audit's rounds, where every rank's model computes its own loss (decided alike on all ranks)."""
        assert self.audit is not None
        if self.config.metrics.replay_every == 0:
            return
        if problem is not None or self._keeper is None:
            self.audit.replay = ReplayEvidence(mode="bitwise", mode_reason="", unavailable=problem)
            return
        module = self.model if self.fsdp.root is self.model else self.model.module  # FSDP2's root, or what DDP wraps
        self._replay = self.hooks.make_replay(module, model_loss, device, [r.device_name for r in self._all_ranks], self.monitor)
        if self._replay is not None:
            self.audit.replay = self._replay.evidence

    def _replay_round(self, step: int) -> None:
        """Collective: replay this step's first micro-batch of one rank on every rank, before the update."""
        assert self._keeper is not None
        self.hooks.beat(step, "replay")
        self._keeper.paused = True
        try:
            with self.capture.paused(), getattr(self.model, "bare", contextlib.nullcontext)():  # not the script's training
                outcome = self._replay.check(step, self._keeper.batch or {})
        finally:
            self._keeper.paused = False
        self.fail_fast.judge(step, {"replay": outcome})

    def _finish(self) -> None:
        """Every rank, at the same step: close the monitor, gather the evidence; rank 0 keeps the report."""
        import torch.distributed as dist

        assert self.audit is not None
        if self.monitor is not None:  # none when the ranks stopped before sharding
            self._record(self.monitor.flush())  # the last step's gather, still in flight
            self.monitor.close()
        loader = self.loaders.training_loader()
        for name, value in self.loaders.evidence().items():
            setattr(self.audit, name, value)
        self.audit.loss_problem = self._loss_problem
        self.audit.extra.update(self.updates.facts)  # the first update's other optimizers (:mod:`.updates`)
        evidence = self.audit.finish(plan_samples=(loader.dataset_size or 0) if loader else 0)
        self.complete = True
        if evidence is None:
            return
        device_type = self._all_ranks[0].device.split(":")[0] if self._all_ranks else "cpu"
        self.report = WorkerReport(
            evidence=evidence, ranks=self._all_ranks, device_type=device_type,
            device_reason=f"the script placed its model on {device_type}", backend=str(dist.get_backend()),
            world_size=dist.get_world_size(), startup_s=self._first_step_at - self.started_at,
            train_s=time.perf_counter() - self._train_started, steps_completed=self.steps_done, stopped_early=self.fail_fast.stop,
        )
