"""The class-level patches that let healthcheck see an unmodified script, installed and removed as one.

Each patch wraps the original and calls back into the session; :class:`Patches` restores every
original on exit, in reverse order, whatever happened in between.

* ``DistributedDataParallel.__init__``: every DDP the script builds (directly, or through
  ``accelerate`` and ``transformers.Trainer``) is handed to the session right after it is built.
* ``torch.distributed._composable.replicate``: a model made data-parallel by torch's composable DDP (torchtitan's
  path) is handed to the session as the DDP it stands for, when the script calls it (:mod:`.replicated`).
* ``DistributedDataParallel.register_comm_hook`` / ``_register_builtin_comm_hook``: DDP has one comm-hook slot.
  The monitor is made at the first forward and leaves a hook registered before it to the script (it reads
  ``.grad``); one registered later, where the monitor took the slot, gets a clear error, not DDP's RuntimeError.
* ``torch.distributed.fsdp.fully_shard``: every module the script shards with FSDP2 is handed to the
  session, which takes the outermost one (the root, sharded last) as the trained model.
* ``torch.distributed.fsdp.FullyShardedDataParallel.__init__`` (FSDP1): refused with a clear error before it shards
  anything (:mod:`.refusals`). Its gradients are reduce-scattered from flat parameters that neither DDP's buckets nor
  FSDP2's per-parameter shards describe, so nothing here would measure them; without this the script reached its
  first optimizer step and was told it had no distributed model at all. So is ``replicate_with_fsdp.replicate``, FSDP2's
  all-reducing sibling, which the session does not follow: it was told to wrap its model in DDP.
* ``torch.distributed.init_process_group``: the session learns when the script's process group exists. DeepSpeed's
  engine, if the script imported it by then, is refused at its construction (:mod:`.refusals`).
* ``torch.multiprocessing.spawn`` / ``start_processes``: a script that starts its own workers cannot be
  probed (healthcheck already is the launcher), so it gets a clear error.
* ``torch.distributed``'s blocking collectives (:data:`BLOCKING_COLLECTIVES`): their time counts as waiting on
  the other ranks (``session.waiting()``), not as the rank's own work in its step time (busy_ms): a script that
  all-reduces its loss to log it would otherwise hand a slow rank's delay to the ranks that waited for it. Before
  the first update, the script's own calls first compare where the ranks are (:mod:`.lockstep`).
* ``_BaseDataLoaderIter._next_index``: the indices of every batch any DataLoader fetches. It is
  private torch API, the one place every loader (DistributedSampler, accelerate's shards) passes
  through; if it moves, the shard audit says it has no evidence rather than breaking the probe.
* ``_BaseDataLoaderIter.__next__``: every batch any DataLoader yields, hashed per sample where no index names one
  (an ``IterableDataset``, a per-rank split: :mod:`.sample_hashes`).
* ``torch.nn.utils``' gradient clipping functions: how the script clips its model (:mod:`.clipping`).
* ``random.seed`` and ``numpy.random.seed``: the seeds the script gives those generators (:mod:`.seeds`).
* ``torch.amp.GradScaler.step``: which scaler steps which optimizer, for the step's loss scale, and the steps it
  skipped (:mod:`.step_facts`).
* ``torch.distributed.algorithms.join.Join.__exit__``: a rank whose loop runs out of inputs before the probe has its
  steps ends the probe there (:mod:`.uneven_inputs`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from healthcheck.errors import InvalidInput
from healthcheck.integrations.script import clipping, refusals, replicated, seeds, step_facts, uneven_inputs
from healthcheck.integrations.script.lockstep import compared_first
from healthcheck.measure.distributed import terminable_while_joining
from healthcheck.measure.wait_clock import counted_as_waiting

#: The ``torch.distributed`` functions whose time is waiting on the other ranks (asynchronous calls return at once).
BLOCKING_COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
)


def refused(message: str) -> Callable[..., Any]:
    """A replacement that refuses the call: exit 2 with ``message``, before it does anything."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise InvalidInput(message)

    return refuse


class Patches:
    """A stack of (owner, attribute, original) that is put back on :meth:`restore`."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """Replace ``owner.name`` by ``make(original)``; a missing attribute is left alone."""
        original = getattr(owner, name, None)
        if original is None:
            return
        self._saved.append((owner, name, original))
        setattr(owner, name, functools.wraps(original)(make(original)))

    def holds(self, owner: Any, name: str) -> bool:
        """Whether ``owner.name`` is wrapped here now."""
        return any(saved is owner and saved_name == name for saved, saved_name, _ in self._saved)

    def restore(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)


def _clipped(session: Any, name: str, parameters: list[Any], args: tuple, kwargs: dict) -> None:
    if session.clips.observe(name, parameters, args, kwargs) and session.model is not None and session.fsdp.root is session.model:
        session.lockstep.at("clip")  # FSDP2's: the norm is a collective, so the ranks first compare where they are


def _collective(session: Any, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """A script's collective: waiting on the others, and before the first update a place the ranks compare."""
    return compared_first(counted_as_waiting(original, lambda: session.waiting()), name, lambda: session.lockstep)


def install(session: Any) -> Patches:
    """Install every patch, calling ``session.on_ddp(ddp)``, ``session.on_fully_shard(module)``, ``session.on_process_group()``,
    ``session.loaders.on_fetch(iterator, indices)``, ``session.loaders.on_batch(iterator, batch)``,
    ``session.owns_comm_hook(ddp)``, ``session.waiting()`` and ``session.clips.observe(...)`` with
    ``session.lockstep``, ``session.seeds.record(...)``, ``session.scales.observe(...)`` and
    ``session.on_scaler_step(optimizer)``."""
    import random

    import numpy
    import torch.distributed as dist
    import torch.multiprocessing as torch_mp
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import dataloader

    patches = Patches()

    def ddp_init(original: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            if replicated.building():  # replicate()'s own DDP, at the first forward: the session has its model
                return original(self, *args, **kwargs)
            session.before_ddp(original, args, kwargs)
            original(self, *args, **kwargs)
            session.on_ddp(self)

        return __init__

    def comm_hook(original: Any) -> Any:
        def register(self: Any, *args: Any, **kwargs: Any) -> Any:
            if session.owns_comm_hook(self):
                raise InvalidInput(
                    "the script registers its own DDP communication hook after the model's first forward, when "
                    "healthcheck's monitor already holds DDP's one slot; register it before the first forward (the "
                    "monitor then reads .grad and leaves the hook to the script) or probe with --set metrics.local_from=grads"
                )
            return original(self, *args, **kwargs)

        return register

    def fully_shard(original: Any) -> Any:
        def shard(module: Any, *args: Any, **kwargs: Any) -> Any:
            for whole in module if isinstance(module, (list, tuple)) else [module]:
                session.before_fully_shard(whole)
            out = original(module, *args, **kwargs)
            # fully_shard also takes a list of modules that share one parameter group.
            for sharded in module if isinstance(module, (list, tuple)) else [module]:
                session.on_fully_shard(sharded)
            return out

        return shard

    def no_fsdp1(original: Any) -> Any:
        return refused(refusals.FSDP1_REFUSED)

    def init_process_group(original: Any) -> Any:
        def init(*args: Any, **kwargs: Any) -> Any:
            with terminable_while_joining():  # a sibling that failed before joining must not hold this rank 30 s
                out = original(*args, **kwargs)
            refusals.refuse_deepspeed(patches)
            session.on_process_group()
            return out

        return init

    def no_spawn(original: Any) -> Any:
        def spawn(*args: Any, **kwargs: Any) -> Any:
            raise InvalidInput(
                "the script starts its own worker processes (torch.multiprocessing.spawn); healthcheck is the "
                "launcher: write the script the torchrun way (read RANK/WORLD_SIZE from the environment)"
            )

        return spawn

    def seen_by(callback: Callable[[Any, Any], None]) -> Callable[[Any], Any]:
        """A DataLoader iterator's method whose result ``callback(iterator, result)`` sees: a fetch's indices, a batch."""

        def make(original: Any) -> Any:
            def method(self: Any) -> Any:
                result = original(self)
                callback(self, result)
                return result

            return method

        return make

    # All or nothing: a wrap that raises midway (an unexpected torch layout) must not leave the earlier ones
    # installed in this process, where they would call back into a session that never started.
    try:
        patches.wrap(DistributedDataParallel, "__init__", ddp_init)
        patches.wrap(DistributedDataParallel, "register_comm_hook", comm_hook)
        patches.wrap(DistributedDataParallel, "_register_builtin_comm_hook", comm_hook)
        # Both public homes of fully_shard: a script imports it from either (torch 2.13 keeps the old one).
        import torch.distributed.fsdp as fsdp

        patches.wrap(fsdp, "fully_shard", fully_shard)
        patches.wrap(fsdp.FullyShardedDataParallel, "__init__", no_fsdp1)
        try:  # FSDP2's data-parallel sibling (torch >= 2.9): reduced by FSDP2's param groups, unmeasured
            import torch.distributed._composable.replicate_with_fsdp as fsdp_replicate

            patches.wrap(fsdp_replicate, "replicate", lambda original: refused(refusals.REPLICATE_WITH_FSDP_REFUSED))
        except ImportError:
            pass
        try:
            import torch.distributed._composable.fsdp as composable_fsdp

            patches.wrap(composable_fsdp, "fully_shard", fully_shard)
        except ImportError:
            pass
        patches.wrap(dist, "init_process_group", init_process_group)
        patches.wrap(torch_mp, "spawn", no_spawn)
        patches.wrap(torch_mp, "start_processes", no_spawn)
        for name in BLOCKING_COLLECTIVES:
            # Looked up per call, as the other patches call back: a session that never meets a collective need not have it.
            patches.wrap(dist, name, functools.partial(_collective, session, name))
        patches.wrap(dataloader._BaseDataLoaderIter, "_next_index", seen_by(lambda it, indices: session.loaders.on_fetch(it, indices)))
        patches.wrap(dataloader._BaseDataLoaderIter, "__next__", seen_by(lambda it, batch: session.loaders.on_batch(it, batch)))
        clipping.patch(patches, lambda *call: _clipped(session, *call))
        step_facts.patch(patches, lambda *call: session.scales.observe(*call), lambda optimizer: session.on_scaler_step(optimizer))
        uneven_inputs.patch(patches, lambda: not session.complete)
        replicated.patch(patches, session.on_ddp)
        patches.wrap(random, "seed", seeds.seeding("python", lambda: session.seeds))
        patches.wrap(numpy.random, "seed", seeds.seeding("numpy", lambda: session.seeds))
    except BaseException:
        patches.restore()
        raise
    return patches
