"""Declarative tensor-parallel modules: ``Module``, ``ShardingConfig``, ``local_map``.

Example::

    from hyper_parallel.dmodule import Module, ShardingConfig, MeshAxisName
    model = MyModel.Config().build()      # or under torch.device("meta")
    model.parallelize(mesh)               # shard states, wrap forwards
    model.init_states()                   # fills only the local shards
"""

from hyper_parallel.config import Configurable
from hyper_parallel.dmodule._forward import compile_local_maps
from hyper_parallel.dmodule.base_model import BaseModel, ModelConfigConverter, ModuleProtocolError
from hyper_parallel.dmodule.model_spec import (
    ModelRegistry,
    ModelSpec,
    UnknownModelError,
    get_spec,
    register_spec,
    unregister_spec,
)
from hyper_parallel.dmodule.module import Module, ModuleDict, ModuleList, Sequential
from hyper_parallel.dmodule.parallel_dims import ParallelDims
from hyper_parallel.dmodule.planner import ShardingError, check_sharding, validate_sharding
from hyper_parallel.dmodule.sharding import (
    LocalMapConfig,
    OutputShardings,
    ShardingConfig,
    resolve_placements,
)
from hyper_parallel.dmodule.types import PLACEMENT_CODEC, MeshAxisName, NamedPlacement

__all__ = [
    "PLACEMENT_CODEC",
    "BaseModel",
    "Configurable",
    "LocalMapConfig",
    "MeshAxisName",
    "ModelConfigConverter",
    "ModelRegistry",
    "ModelSpec",
    "Module",
    "ModuleDict",
    "ModuleList",
    "ModuleProtocolError",
    "NamedPlacement",
    "OutputShardings",
    "ParallelDims",
    "Sequential",
    "ShardingConfig",
    "ShardingError",
    "UnknownModelError",
    "check_sharding",
    "compile_local_maps",
    "get_spec",
    "register_spec",
    "resolve_placements",
    "unregister_spec",
    "validate_sharding",
]
