"""Count the collectives a piece of eager code issues, by kind, whatever engine issues them."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

# Collective op names as the dispatcher sees them (c10d process-group ops and functional
# collectives), folded to one name per kind.
_KIND_OF_OP: dict[str, str] = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "reduce_": "reduce",
    "gather_": "gather",
    "scatter_": "scatter",
}
_COLLECTIVE_NAMESPACES = (
    "c10d",
    "_c10d_functional",
    "c10d_functional",
    "_c10d_functional_autograd",
)


def _is_engine_subclass(tensor_type: type) -> bool:
    """A tensor subclass that lowers ops itself (a DTensor); fake tensors used for shape
    propagation are not one."""
    if tensor_type is torch.Tensor or tensor_type is torch.nn.Parameter:
        return False
    return not issubclass(tensor_type, FakeTensor)


class CollectiveCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts collectives by kind (``all_reduce``, ``all_gather``, ...) while active.

    Ops on tensor subclasses (torch's DTensor, ours) are passed back to the subclass first
    (``NotImplemented``), so the collectives it lowers to are counted, not the op itself.

    Example:
        >>> with CollectiveCounter() as counter:  # doctest: +SKIP
        ...     dist.all_reduce(torch.ones(2))
        >>> counter.counts
        Counter({'all_reduce': 1})
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Any = (),
        kwargs: Any = None,
    ) -> Any:
        if any(_is_engine_subclass(t) for t in types):
            return NotImplemented
        schema_name = getattr(func, "_schema", None)
        if schema_name is not None:
            namespace, _, op = schema_name.name.partition("::")
            if namespace in _COLLECTIVE_NAMESPACES and op in _KIND_OF_OP:
                self.counts[_KIND_OF_OP[op]] += 1
        return func(*args, **(kwargs or {}))
