"""What the reference models' plans share: head-count checks, compile, FSDP's mixed precision,
the pipeline call.

Each model's plan still lives in its own file (``llama_sharding.py``, ``qwen3_sharding.py``);
what is the same logic in both (and in their Configs' checks) is written once here and
called from there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, TypeVar

import torch

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule._checks import require_positive
from hyper_parallel.dmodule._forward import compile_local_maps
from hyper_parallel.dmodule.base_model import BaseModel
from hyper_parallel.dmodule.layers import cross_entropy
from hyper_parallel.dmodule.parallel_dims import ParallelDims
from hyper_parallel.dmodule.pipeline import Pipeline, pipeline
from hyper_parallel.dmodule.types import MeshAxisName, axis_name
from hyper_parallel.dtensor import DeviceMesh
from hyper_parallel.dtensor.fsdp import MixedPrecisionPolicy

__all__ = [
    "apply_compile",
    "check_head_sizes",
    "check_heads_divide_tp",
    "mp_policy",
    "pipeline_with_loss",
    "tp_size",
]

#: The options a model's ``pipelining_fn`` reads from ``job_config["pipeline"]``.
PIPELINE_OPTIONS = ("schedule", "n_microbatches", "stages_per_rank", "split")


class _HeadCounts(Protocol):
    n_heads: int
    n_kv_heads: int | None


class _HeadSizes(_HeadCounts, Protocol):
    dim: int


_M = TypeVar("_M", bound=torch.nn.Module)


def tp_size(mesh: DeviceMesh | ParallelDims) -> int | None:
    """The size of mesh axis ``tp`` (``None``: a mesh without one; a ParallelDims always has one).

    Example::

        >>> tp_size(ParallelDims(dp_shard=2, tp=2, world_size=4))
        2
    """
    if isinstance(mesh, ParallelDims):
        return mesh.tp
    names = tuple(mesh.mesh_dim_names or ())
    tp_name = axis_name(MeshAxisName.TP)
    return mesh.size(names.index(tp_name)) if tp_name in names else None


def check_head_sizes(config: _HeadSizes, *, dim_path: str = "dim") -> None:
    """A Config's head layout, or a ``ConfigError`` naming the field: ``n_heads`` divides by
    ``n_kv_heads``; ``dim`` by ``n_heads`` unless the Config gives its own ``head_dim``
    (then an int >= 1). ``dim_path``: the field an indivisible ``dim`` is reported on.

    Example::

        >>> from types import SimpleNamespace
        >>> check_head_sizes(SimpleNamespace(dim=64, n_heads=4, n_kv_heads=3))
        Traceback (most recent call last):
        ...
        hyper_parallel.config.errors.ConfigError: n_kv_heads: expected n_heads (4) to divide by n_kv_heads, found 3
    """
    has_head_dim = hasattr(config, "head_dim")  # Qwen3's; Llama's is dim / n_heads
    if getattr(config, "head_dim", None) is not None:
        require_positive(config, "head_dim")
    elif config.dim % config.n_heads:
        given = " when head_dim is not given" if has_head_dim else ""
        raise ConfigError(
            f"expected dim to divide by n_heads ({config.n_heads}){given}, found {config.dim}",
            path=dim_path,
        )
    n_kv = config.n_kv_heads if config.n_kv_heads is not None else config.n_heads
    if config.n_heads % n_kv:
        raise ConfigError(
            f"expected n_heads ({config.n_heads}) to divide by n_kv_heads, found {n_kv}",
            path="n_kv_heads",
        )


def check_heads_divide_tp(
    config: _HeadCounts, mesh: DeviceMesh | ParallelDims, *, where: str
) -> None:
    """Raise a ``ValueError`` unless ``n_heads`` and ``n_kv_heads`` divide by the ``tp`` size.

    Example::

        >>> from types import SimpleNamespace
        >>> check_heads_divide_tp(SimpleNamespace(n_heads=3, n_kv_heads=3),
        ...                       ParallelDims(tp=2, world_size=2), where="Llama.parallelize")
        Traceback (most recent call last):
        ...
        ValueError: Llama.parallelize: n_heads (3) and n_kv_heads (3) must divide by the size of mesh axis 'tp' (2)
    """
    tp = tp_size(mesh)
    if tp is None:
        return
    n_kv = config.n_kv_heads if config.n_kv_heads is not None else config.n_heads
    if config.n_heads % tp or n_kv % tp:
        raise ValueError(
            f"{where}: n_heads ({config.n_heads}) and n_kv_heads ({n_kv}) must "
            f"divide by the size of mesh axis 'tp' ({tp})"
        )


def apply_compile(model: _M) -> _M:
    """``torch.compile`` the ``local_map`` blocks' local math when ``compile_local_map`` is set.

    Example::

        apply_compile(model)  # after apply_tp: a no-op unless model.config.compile_local_map
    """
    if getattr(getattr(model, "config", None), "compile_local_map", False):
        compile_local_maps(model)
    return model


def mp_policy(job_config: object, *, where: str) -> MixedPrecisionPolicy:
    """The ``MixedPrecisionPolicy`` a job config gives every ``fully_shard`` (default: none).

    Read from ``job_config["mp_policy"]`` (or ``job_config.mp_policy``): TorchTitan's one
    policy (``param_dtype``, ``reduce_dtype``) for all of a model's FSDP units. Anything
    else is refused, naming ``where``, before the model changes.

    Example::

        >>> mp_policy({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)},
        ...           where="parallelize_llama").param_dtype
        torch.bfloat16
        >>> mp_policy(None, where="parallelize_llama")
        MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None, output_dtype=None, cast_forward_inputs=True)
    """
    if isinstance(job_config, Mapping):
        found = job_config.get("mp_policy")
    else:
        found = getattr(job_config, "mp_policy", None)
    if found is None:
        return MixedPrecisionPolicy()
    if not isinstance(found, MixedPrecisionPolicy):
        raise TypeError(
            f"{where}: job_config['mp_policy']: expected a MixedPrecisionPolicy, "
            f"found {type(found).__name__} {found!r}"
        )
    return found


def pipeline_with_loss(
    model: BaseModel, mesh: DeviceMesh | ParallelDims, job_config: object, *, where: str
) -> Pipeline:
    """A model spec's ``pipelining_fn``: :func:`~hyper_parallel.dmodule.pipeline.pipeline`
    with the loss-parallel ``cross_entropy``.

    ``job_config["pipeline"]`` (a mapping) may give ``schedule``, ``n_microbatches``
    (default: the ``pp`` size), ``stages_per_rank`` and ``split``; another key is refused,
    named, before anything is built. The other keys of ``job_config`` reach each stage's
    ``parallelize_fn`` (``activation_checkpoint``, ``mp_policy``).

    Example::

        pipe = pipeline_with_loss(model, ParallelDims(pp=2, dp_shard=2),
                                  {"pipeline": {"schedule": "GPipe"}}, where="pipeline_llama")
    """
    section = job_config.get("pipeline", {}) if isinstance(job_config, Mapping) else {}
    options = dict(section)
    unknown = sorted(set(options) - set(PIPELINE_OPTIONS))
    if unknown:
        raise ValueError(
            f"{where}: job_config['pipeline'] names {unknown}; expected schedule, "
            f"n_microbatches, stages_per_rank or split"
        )
    pp = mesh.pp if isinstance(mesh, ParallelDims) else mesh.size(axis_name(MeshAxisName.PP))
    if pp > 1 and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        raise ValueError(
            f"{where}: tie_word_embeddings=True shares one weight between the embedding (first "
            f"pipeline stage) and the output (last stage), which pp={pp} puts on different "
            "ranks; untie them (tie_word_embeddings=false) or use pp=1"
        )
    options.setdefault("n_microbatches", pp)
    # the rest of job_config is each stage's parallelize_fn's (activation_checkpoint, mp_policy)
    rest = (
        {k: v for k, v in job_config.items() if k != "pipeline"}
        if isinstance(job_config, Mapping)
        else None
    )
    return pipeline(model, mesh, loss_fn=cross_entropy, parallelize_options=rest, **options)
