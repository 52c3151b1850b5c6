"""What the reference models' plans share: head-count checks, region blocks, compile, FSDP's
mesh and mixed precision, the pipeline call.

Each model's plan still lives in its own file (``llama_sharding.py``, ``qwen3_sharding.py``);
what is the same logic in both (and in their Configs' checks) is written once here and
called from there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol, TypeVar

import torch

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule._checks import require_positive
from hyper_parallel.dmodule._forward import compile_local_maps
from hyper_parallel.dmodule.base_model import BaseModel
from hyper_parallel.dmodule.context_parallel import CP_AXIS
from hyper_parallel.dmodule.layers import RMSNorm, cross_entropy
from hyper_parallel.dmodule.layers._common import replicated, sequence_sharded
from hyper_parallel.dmodule.module import Module
from hyper_parallel.dmodule.parallel_dims import ParallelDims
from hyper_parallel.dmodule.pipeline import Pipeline, pipeline
from hyper_parallel.dmodule.sharding import LocalMapConfig, ShardingConfig
from hyper_parallel.dmodule.types import MeshAxisName, axis_name
from hyper_parallel.dtensor import DeviceMesh
from hyper_parallel.dtensor.fsdp import MixedPrecisionPolicy

__all__ = [
    "DataParallelMesh",
    "apply_compile",
    "check_head_sizes",
    "check_heads_divide_tp",
    "check_whole_plan",
    "data_parallel_mesh",
    "mp_policy",
    "pipeline_with_loss",
    "region_block_parts",
    "residual_stream_region",
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


def check_whole_plan(mesh: DeviceMesh | ParallelDims, *, where: str, plan: str) -> None:
    """Refuse data parallelism that ``plan`` (a model's ``parallelize_fn``) leaves to the
    training step, for a model's own ``parallelize``: plain replicas are averaged by
    ``train_step(average_over=...)`` (hp-train does it), so ``model.parallelize`` alone
    would apply only half of the layout. Raises before anything changes.

    Example::

        >>> check_whole_plan(ParallelDims(dp_shard=2, world_size=2), where="M", plan="p")
        >>> check_whole_plan(ParallelDims(dp_replicate=2, dp_shard=1, world_size=2),
        ...                  where="M.parallelize", plan="parallelize_m")
        Traceback (most recent call last):
        ...
        ValueError: M.parallelize: dp_replicate=2 with dp_shard x cp = 1: ...
    """
    if isinstance(mesh, ParallelDims):
        if mesh.dp_replicate > 1 and not mesh.fsdp_enabled:
            raise ValueError(
                f"{where}: dp_replicate={mesh.dp_replicate} with dp_shard x cp = 1: plain "
                f"replicas, which neither {where} nor {plan} synchronise (the training step "
                "averages their gradients: train_step(..., average_over=(dims.batch_mesh, "
                "'batch')), as hp-train does); expected dp_shard > 1 (FSDP, HSDP with "
                "dp_replicate), or parallelize over ParallelDims without dp_replicate and "
                "average the gradients in the step"
            )
        return
    names = tuple(mesh.mesh_dim_names or ())
    shard = axis_name(MeshAxisName.DP_SHARD)
    for axis in (axis_name(MeshAxisName.DP), axis_name(MeshAxisName.DP_REPLICATE)):
        if axis in names and mesh.size(axis) > 1 and shard not in names:
            raise ValueError(
                f"{where}: mesh axis {axis!r} ({mesh.size(axis)} ranks) of {mesh}: data "
                f"parallelism over it is not applied by {where} nor {plan} (only a "
                f"{shard!r} axis is: FSDP); expected an axis named {shard!r}, or "
                f"parallelize over the other axes (e.g. mesh['tp']) and average the "
                f"gradients over {axis!r} in the step (average_gradients(model, mesh, "
                f"{axis!r}) or train_step(..., average_over=(mesh, {axis!r})))"
            )


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


class DataParallelMesh(NamedTuple):
    """What ``fully_shard`` runs over (``mesh``) and how many ranks read different data (``dp``)."""

    mesh: DeviceMesh
    dp: int


def data_parallel_mesh(
    mesh: DeviceMesh | ParallelDims, *, cp: int = 1, where: str
) -> DataParallelMesh | None:
    """The data-parallel mesh a plan's ``apply_fsdp`` shards over (``None``: no FSDP here).

    A :class:`ParallelDims` gives its ``fsdp_mesh`` (``dp_shard`` x ``cp`` flattened, with
    ``dp_replicate`` for HSDP) when ``fsdp_enabled``. A mesh gives its ``dp_shard`` axis, with
    ``dp_replicate`` when that has more than one rank (HSDP), and none without a ``dp_shard``
    axis. A model split over ``cp > 1`` ranks on a plain mesh shards over ``(dp_shard, cp)``
    (replicated over ``dp_shard``, sharded over ``cp``); with ``dp_replicate`` too, that is
    refused, naming ``where``: only a ParallelDims lays out all three.

    Example::

        >>> data_parallel_mesh(ParallelDims(tp=2, world_size=2), where="apply_fsdp") is None
        True
    """
    if isinstance(mesh, ParallelDims):
        return DataParallelMesh(mesh.fsdp_mesh, mesh.dp) if mesh.fsdp_enabled else None
    names = tuple(mesh.mesh_dim_names or ())
    shard, replicate = axis_name(MeshAxisName.DP_SHARD), axis_name(MeshAxisName.DP_REPLICATE)
    if shard not in names:
        return None
    hsdp = replicate in names and mesh.size(names.index(replicate)) > 1
    if cp > 1 and hsdp:
        raise ValueError(
            f"{where}: dp_replicate x dp_shard x cp on a plain DeviceMesh is not supported; "
            "pass a ParallelDims (its fsdp view flattens dp_shard x cp)"
        )
    dp = mesh.size(names.index(shard)) * (mesh.size(names.index(replicate)) if hsdp else 1)
    if cp > 1:
        return DataParallelMesh(mesh[(shard, CP_AXIS)], dp)
    return DataParallelMesh(mesh[(replicate, shard)] if hsdp else mesh[shard], dp)


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


def residual_stream_region(sequence_parallel: bool) -> ShardingConfig:
    """A block as an OUTER ``local_map`` region: the residual stream in and out.

    ``Replicate`` over ``tp`` (``Shard(1)``, sequence shards, with ``sequence_parallel``):
    the block's input goes local once and its output is wrapped once; the residual adds
    between its parts are plain torch, and its norms, attention and feed-forward are
    inner regions that make their declared moves as collectives on local tensors
    (``README``: regions inside a region).

    Example::

        >>> residual_stream_region(True).out_src_shardings
        {MeshAxisName.TP: Shard(dim=1)}
    """
    stream = sequence_sharded() if sequence_parallel else replicated()
    return ShardingConfig(
        in_dst_shardings={"x": stream}, out_src_shardings=stream, local_map=LocalMapConfig()
    )


def region_block_parts(
    dim: int,
    eps: float,
    sequence_parallel: bool,
    attention: Module.Config,
    feed_forward: Module.Config,
) -> dict[str, Any]:
    """A region block's parts (the keyword arguments of the model's block ``Config``).

    The norms are ``local_map`` regions in either layout (with ``sequence_parallel`` their
    replicated weight's local gradient is declared ``Partial``); with ``sequence_parallel``
    attention's and feed-forward's input is declared a sequence shard (``in_src``), as the
    norm leaves it: an inner region receives plain tensors, whose layout is only what it
    declares. The block's own layout is :func:`residual_stream_region`'s.

    Example::

        >>> from hyper_parallel.dmodule.layers import Attention, FeedForward
        >>> parts = region_block_parts(8, 1e-6, False, Attention.Config(dim=8, n_heads=2),
        ...                            FeedForward.Config(dim=8, hidden_dim=16))
        >>> sorted(parts)
        ['attention', 'attention_norm', 'feed_forward', 'ffn_norm', 'sharding_config']
    """
    norm = RMSNorm.Config.local_map(dim, eps=eps, sequence_parallel=sequence_parallel)
    if sequence_parallel:
        attention = attention.replace(sharding_config=_sequence_shard_in(attention))
        feed_forward = feed_forward.replace(sharding_config=_sequence_shard_in(feed_forward))
    return {
        "attention_norm": norm,
        "attention": attention,
        "ffn_norm": norm.replace(),
        "feed_forward": feed_forward,
        "sharding_config": residual_stream_region(sequence_parallel),
    }


def _sequence_shard_in(part: Module.Config) -> ShardingConfig:
    sharding = part.sharding_config
    assert sharding is not None  # the tensor-parallel presets declare one
    return dataclasses.replace(sharding, in_src_shardings={"x": sequence_sharded()})
