"""Tensor parallelism on hp DTensors: torch's ``torch.distributed.tensor.parallel`` API.

A torch TP program runs on hp-dtensor by changing its imports.

Example::

    from hyper_parallel.dtensor import init_device_mesh
    from hyper_parallel.dtensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = parallelize_module(model, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
"""

from hyper_parallel.dtensor.parallel._local_linear import overlap_grad_reduce
from hyper_parallel.dtensor.parallel.api import parallelize_module
from hyper_parallel.dtensor.parallel.loss import loss_parallel
from hyper_parallel.dtensor.parallel.style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    check_plain_shard_input,
)

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "check_plain_shard_input",
    "loss_parallel",
    "overlap_grad_reduce",
    "parallelize_module",
]
