"""``FSDPState``: the hooks and flags of one ``fully_shard`` call, and the FSDP roots.

A state owns one :class:`~hyper_parallel.dtensor.fsdp._param_group.FSDPParamGroup` and
the hooks that drive it, as torch's ``FSDPState`` does:

- forward pre-hook: all-gather the group (and the modules set to forward-prefetch);
- forward post-hook: reshard if ``reshard_after_forward``, cast outputs, and hook the
  outputs so that their first gradient re-all-gathers a resharded group (pre-backward);
- a post-accumulate-grad hook on each unsharded parameter: when the group's last
  gradient is there, one reduce-scatter writes the sharded gradients;
- the root's callback at the end of backward (``queue_callback``) reduces the groups
  whose parameters did not all get a gradient and resets the iteration.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from hyper_parallel.dtensor.fsdp._api import MixedPrecisionPolicy
from hyper_parallel.dtensor.fsdp._param_group import FSDPParamGroup

if TYPE_CHECKING:
    from hyper_parallel.dtensor.fsdp._fully_shard import FSDPModule


class FSDPState:
    """The hooks and flags of one ``fully_shard`` call over ``modules``."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        group: FSDPParamGroup,
        mp: MixedPrecisionPolicy,
        reshard_after_forward: bool,
        auto_reshard: bool,
    ) -> None:
        self.modules = modules
        self.group = group
        self.mp = mp
        self.reshard_after_forward = reshard_after_forward
        self.auto_reshard = auto_reshard
        self.is_root: bool | None = None
        self.forward_prefetch: list[FSDPModule] = []
        self.backward_prefetch: list[FSDPModule] = []
        self.is_last_backward = True
        self._forwarded: set[int] = set()
        self._callback_queued = False
        self._all_states: list[FSDPState] = []  # the root's: every state under it

    # -- lazy init -------------------------------------------------------------------
    def _lazy_init(self) -> None:
        if self.is_root is not None:
            return
        # The first state to run forward is the root: the states under it are not.
        self.is_root = True
        states: list[FSDPState] = []
        for module in self.modules:
            for sub in module.modules():
                state = _state_of(sub)
                if state is not None and state not in states:
                    states.append(state)
        for state in states:
            if state is not self:
                state.is_root = False
        if self.auto_reshard:
            self.reshard_after_forward = False
        self._all_states = states

    # -- forward -----------------------------------------------------------------------
    def pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        self._lazy_init()
        if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.mp.param_dtype)
        self.group.unshard()
        for other in self.forward_prefetch:
            other._get_fsdp_state().group.unshard()
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        # fully_shard([a, b]): the group reshards once the last of its modules ran forward
        self._forwarded.add(id(module))
        if len(self._forwarded) >= len(self.modules):
            self._forwarded.clear()
            if self.reshard_after_forward:
                self.group.reshard()
        if torch.is_grad_enabled():
            tensors = [
                t
                for t in tree_flatten(output)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, self._pre_backward, mode="any"
                )
        if self.mp.output_dtype is not None:
            output = _cast_floats(output, self.mp.output_dtype)
        return output

    # -- backward ----------------------------------------------------------------------
    def _pre_backward(self, _: torch.Tensor) -> None:
        root = self._root()
        if root is not None and not root._callback_queued:
            root._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(root._post_backward_final)
        if self.group.in_backward:
            return
        self.group.in_backward = True
        self.group.unshard()
        for other in self.backward_prefetch:
            other._get_fsdp_state().group.unshard()

    def _root(self) -> FSDPState | None:
        if self.is_root:
            return self
        for state in _all_root_states():
            if self in state._all_states:
                return state
        return None

    def _post_backward_final(self) -> None:
        self._callback_queued = False
        for state in reversed(self._all_states):
            group = state.group
            if group.in_backward or group.is_unsharded:
                group.post_backward()
                if group.reshard_after_backward:
                    group.reshard()
            group.reset_backward()


_roots: weakref.WeakSet[Any] = weakref.WeakSet()


def _all_root_states() -> list[FSDPState]:
    return [m._get_fsdp_state() for m in _roots]


def _state_of(module: nn.Module) -> FSDPState | None:
    state = getattr(module, "_hp_fsdp_state", None)
    return state if isinstance(state, FSDPState) else None


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    def cast_one(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            return t.to(dtype)
        return t

    return tree_map(cast_one, tree)
