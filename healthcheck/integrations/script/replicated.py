"""torch's composable ``replicate()``, torchtitan's data-parallel path, handed to the session as the DDP model it is.

``replicate(model)`` (``torch.distributed._composable.replicate``) leaves the model in place and hooks it: at its first
forward a pre-hook builds a ``DistributedDataParallel`` over an ``nn.ParameterList`` of its parameters, then runs that
DDP's pre-forward, and a forward hook runs its post-forward. The DDP itself is never called and its ``.module`` is
no model, so the session's hooks on it never ran: a torchtitan-style loop was refused, exit 2, "the script stepped
its optimizer before a forward through its DistributedDataParallel model ... call the DDP model, not its .module".

:class:`ReplicatedDDP` stands for the wrapper. Its ``.module`` is the model; its own forward hooks run where DDP's
wrapper hooks would, around replicate's: ``replicate``'s two hooks on the model are replaced, in place, by
dispatchers that run the wrapper's pre-hooks after building the DDP and before its pre-forward (where the ranks
broadcast), the hooks that must see the module after it (:meth:`ReplicatedDDP.register_module_pre_hook`), and the
wrapper's forward hooks after its post-forward. Everything else (the reducer, the comm hook, DDP's settings) is the
inner DDP's, and the wrapper's hooks are handed that DDP. The DDP is built where replicate builds it, at the first
forward, so the script's order of initialising, loading and wrapping is left as it is.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Callable, Iterator

from healthcheck.errors import InvalidInput

#: Set while a :class:`ReplicatedDDP` builds its inner DDP: the DDP patch leaves that one to it.
_building: list[Any] = []


def building() -> bool:
    """Whether the DDP being constructed now is a replicated model's inner one."""
    return bool(_building)


class _Handle:
    """What ``register_forward_pre_hook`` returns: ``remove()`` takes the hook out of its list."""

    def __init__(self, hooks: dict[int, Any], key: int):
        self._hooks, self._key = hooks, key

    def remove(self) -> None:
        self._hooks.pop(self._key, None)


class ReplicatedDDP:
    """The DDP wrapper of a model ``replicate()`` made data-parallel (see the module docstring)."""

    def __init__(self, module: Any, state: Any):
        self.module, self._state = module, state
        self._keys = itertools.count()
        self._pre: dict[int, Callable[..., Any]] = {}
        self._module_pre: dict[int, Callable[..., Any]] = {}
        self._post: dict[int, Callable[..., Any]] = {}
        self._bare = False
        self._replace_hooks()

    def __getattr__(self, name: str) -> Any:
        """``ddp``: the inner ``DistributedDataParallel``; any other name this class lacks is that DDP's. Both raise
        AttributeError before the model's first forward builds it (``getattr(model, name, default)`` reads the default)."""
        if name.startswith("_"):
            raise AttributeError(name)
        inner = getattr(self.__dict__.get("_state"), "_ddp", None)
        if inner is None:
            raise AttributeError(f"{name}: the replicated model's DDP is built at its first forward")
        return inner if name == "ddp" else getattr(inner, name)

    def parameters(self) -> Iterator[Any]:
        return self.module.parameters()

    def register_forward_pre_hook(self, hook: Callable[..., Any], **_: Any) -> _Handle:
        """``hook(ddp, args)`` before DDP's pre-forward, once the DDP exists, in order of registration."""
        return self._add(self._pre, hook)

    def register_forward_hook(self, hook: Callable[..., Any], **_: Any) -> _Handle:
        """``hook(ddp, args, output)`` after DDP's post-forward. Not called when the forward raises: replicate's own
        post-forward is not either."""
        return self._add(self._post, hook)

    def register_module_pre_hook(self, hook: Callable[..., Any]) -> _Handle:
        """``hook(module, args)`` after DDP's pre-forward, before the model's other pre-hooks: what a pre-hook
        prepended on a DDP's ``.module`` sees."""
        return self._add(self._module_pre, hook)

    @contextlib.contextmanager
    def bare(self) -> Iterator[None]:
        """The model's forwards without DDP's pre- and post-forward (the replay's, as DDP's ``.module`` runs)."""
        self._bare = True
        try:
            yield
        finally:
            self._bare = False

    def _add(self, table: dict[int, Callable[..., Any]], hook: Callable[..., Any]) -> _Handle:
        key = next(self._keys)
        table[key] = hook
        return _Handle(table, key)

    def _replace_hooks(self) -> None:
        """Put the dispatchers where replicate's two hooks are, keeping their places among the model's hooks."""
        module, kind = self.module, type(self._state)
        pre_key = next((k for k, h in module._forward_pre_hooks.items() if getattr(h, "__func__", None) is kind.forward_pre_hook), None)
        post_key = next((k for k, h in module._forward_hooks.items() if getattr(h, "__func__", None) is kind.forward_post_hook), None)
        if pre_key is None or post_key is None:  # another torch's replicate(): a clear refusal, not a StopIteration
            raise InvalidInput("this torch's replicate() runs DDP from hooks healthcheck does not find on the model; probe the "
                               "model wrapped in torch.nn.parallel.DistributedDataParallel instead")
        module._forward_pre_hooks[pre_key] = self._before
        module._forward_hooks[post_key] = self._after

    def _before(self, module: Any, args: Any, kwargs: Any) -> Any:
        if self._bare:
            return None
        state = self._state
        if state._init_args or state._init_kwargs:  # replicate builds its DDP at the first forward: so does this
            _building.append(self)
            try:
                state.lazy_init()
            finally:
                _building.pop()
        for hook in list(self._pre.values()):
            hook(self.ddp, args)
        out = state.forward_pre_hook(module, args, kwargs)  # DDP's pre-forward
        for hook in list(self._module_pre.values()):
            hook(module, out[0] if out is not None else args)
        return out

    def _after(self, module: Any, args: Any, output: Any) -> Any:
        if self._bare:
            return None
        output = self._state.forward_post_hook(module, args, output)  # DDP's post-forward
        for hook in list(self._post.values()):
            hook(self.ddp, args, output)
        return output


def patch(patches: Any, on_replicated: Callable[[ReplicatedDDP], None]) -> None:
    """Wrap ``replicate`` in both its homes: each model it makes data-parallel is handed to ``on_replicated``."""
    import importlib

    try:  # the package's ``replicate`` is the function; the module is its home
        composable = importlib.import_module("torch.distributed._composable")
        home = importlib.import_module("torch.distributed._composable.replicate")
    except ImportError:
        return
    original = getattr(home, "replicate", None)
    if original is None or not hasattr(original, "state"):
        return

    def make(wrapped: Any) -> Any:
        def replicate(module: Any, *args: Any, **kwargs: Any) -> Any:
            out = wrapped(module, *args, **kwargs)
            on_replicated(ReplicatedDDP(module, original.state(module)))
            return out

        return replicate

    patches.wrap(home, "replicate", make)
    if getattr(composable, "replicate", None) is original:  # the package's name for the same function
        patches.wrap(composable, "replicate", make)
