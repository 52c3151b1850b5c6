"""The reference Llama-style decoder, tensor parallel over ``tp`` as its layers' Configs declare.

Importing this module registers it as the :class:`~hyper_parallel.dmodule.ModelSpec`
``"llama-ref"`` (flavors ``"debug"``, ``"small"``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule._checks import require_positive, require_positive_float
from hyper_parallel.dmodule._forward import compile_local_maps
from hyper_parallel.dmodule.activation_checkpoint import (
    apply_activation_checkpointing,
    checkpoint_mode,
)
from hyper_parallel.dmodule.base_model import BaseModel
from hyper_parallel.dmodule.containers import ModuleList
from hyper_parallel.dmodule.layers import (
    Embedding,
    Linear,
    RMSNorm,
    TransformerBlock,
    cross_entropy,
)
from hyper_parallel.dmodule.model_spec import ModelSpec, register_spec
from hyper_parallel.dmodule.models.llama_hf import LlamaStateDictAdapter, llama_config_from_hf
from hyper_parallel.dmodule.pipeline import Pipeline, PipelineSplit, pipeline
from hyper_parallel.dmodule.types import MeshAxisName, NamedPlacement, axis_name
from hyper_parallel.dtensor import DeviceMesh, Replicate, Shard
from hyper_parallel.dtensor.fsdp import fully_shard

__all__ = [
    "LLAMA_PIPELINE_SPLIT",
    "LLAMA_SPEC",
    "Llama",
    "apply_fsdp",
    "parallelize_llama",
    "pipeline_llama",
]


class Llama(BaseModel):
    """Token embedding → ``n_layers`` x :class:`TransformerBlock` → RMSNorm → output projection.

    Tensor-parallel plan (all declared in the layers' Configs, over mesh axis ``tp``):
    vocab-parallel embedding; per block, column-parallel ``wq/wk/wv/w1/w3`` and
    row-parallel ``wo/w2`` (heads and hidden units sharded); replicated norms; a
    column-parallel output whose logits stay sharded by vocab into the loss-parallel
    :func:`~hyper_parallel.dmodule.layers.cross_entropy`. ``use_local_map`` runs
    attention and feed-forward on local tensors (``compile_local_map`` compiles their
    local math with ``torch.compile``); ``sequence_parallel`` keeps the
    residual stream split along the sequence between blocks.

    Example::

        >>> model = Llama.Config(vocab_size=32, dim=16, n_layers=1, n_heads=2,
        ...                      ffn_dim=32, max_seq_len=8).build()
        >>> model.init_weights()
        >>> tokens = torch.randint(0, 32, (2, 8))
        >>> model(tokens).shape, model.loss(tokens, tokens).ndim
        (torch.Size([2, 8, 32]), 0)
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        """The model's hyperparameters; the blocks' Configs are derived from them.

        Example::

            >>> Llama.Config().apply_overrides(["dim=32", "use_local_map=true"]).dim
            32
        """

        vocab_size: int = 256
        dim: int = 64
        n_layers: int = 2
        n_heads: int = 4
        n_kv_heads: int | None = 2
        ffn_dim: int = 128
        max_seq_len: int = 64
        norm_eps: float = 1e-6
        rope_theta: float = 10000.0
        use_rope: bool = True
        use_local_map: bool = False
        compile_local_map: bool = False  # torch.compile the local_map blocks' local math
        sequence_parallel: bool = False
        vocab_parallel: bool = True

        def validate(self) -> None:
            """Sizes that type-check but cannot make a model are a ``ConfigError`` naming the field.

            Example::

                >>> Llama.Config(n_heads=0)
                Traceback (most recent call last):
                ...
                hyper_parallel.config.errors.ConfigError: n_heads: expected an int >= 1, found 0
            """
            BaseModel.Config.validate(self)
            require_positive(
                self,
                "vocab_size",
                "dim",
                "n_layers",
                "n_heads",
                "n_kv_heads",
                "ffn_dim",
                "max_seq_len",
            )
            require_positive_float(self, "norm_eps", "rope_theta")
            if self.compile_local_map and not self.use_local_map:
                raise ConfigError(
                    "expected use_local_map=true with compile_local_map (it compiles the "
                    "local_map blocks), found use_local_map=false",
                    path="compile_local_map",
                )
            if self.dim % self.n_heads:
                raise ConfigError(
                    f"expected dim to divide by n_heads ({self.n_heads}), found {self.dim}",
                    path="dim",
                )
            n_kv = self.n_kv_heads if self.n_kv_heads is not None else self.n_heads
            if self.n_heads % n_kv:
                raise ConfigError(
                    f"expected n_heads ({self.n_heads}) to divide by n_kv_heads, found {n_kv}",
                    path="n_kv_heads",
                )
            if self.use_rope and (self.dim // self.n_heads) % 2:
                raise ConfigError(
                    f"expected an even head dim (dim / n_heads) for rotary embeddings, found "
                    f"{self.dim} / {self.n_heads} = {self.dim // self.n_heads}",
                    path="dim",
                )

        @classmethod
        def from_hf(cls, directory: str | os.PathLike[str]) -> Llama.Config:
            """The Config of a transformers Llama checkpoint directory (its ``config.json``).

            Example::

                >>> Llama.Config.from_hf("path/to/Llama-3.2-1B").n_layers  # doctest: +SKIP
                16
            """
            return llama_config_from_hf(cls, directory)

        def block(self) -> TransformerBlock.Config:
            """The Config of every block.

            Example::

                >>> Llama.Config(n_heads=8).block().attention.n_heads
                8
            """
            return TransformerBlock.Config.llama(
                dim=self.dim,
                n_heads=self.n_heads,
                n_kv_heads=self.n_kv_heads,
                ffn_dim=self.ffn_dim,
                max_seq_len=self.max_seq_len,
                norm_eps=self.norm_eps,
                rope_theta=self.rope_theta,
                use_rope=self.use_rope,
                local_map=self.use_local_map,
                sequence_parallel=self.sequence_parallel,
            )

        def get_nparams_and_flops(self, model: torch.nn.Module, seq_len: int) -> tuple[int, float]:
            """Parameters and training FLOPs per token, attention's sequence term included.

            Example::

                >>> cfg = Llama.Config()
                >>> cfg.get_nparams_and_flops(cfg.build(), 64)[0]
                106816
            """
            nparams, flops = BaseModel.Config.get_nparams_and_flops(self, model, seq_len)
            head_dim = self.dim // self.n_heads
            return nparams, flops + 12.0 * self.n_layers * self.n_heads * head_dim * seq_len

    def __init__(self, config: Llama.Config) -> None:
        super().__init__()
        self.config = config
        sp = config.sequence_parallel
        if config.vocab_parallel:
            embedding = Embedding.Config.vocab_parallel(
                config.vocab_size, config.dim, sequence_parallel=sp
            )
            output = Linear.Config.colwise(config.dim, config.vocab_size, sequence_parallel=sp)
        else:
            embedding = Embedding.Config.replicated(config.vocab_size, config.dim)
            output = Linear.Config.replicated(config.dim, config.vocab_size)
        self.tok_embeddings = embedding.build()
        block = config.block()
        self.layers = ModuleList([block.build() for _ in range(config.n_layers)])
        if sp:
            norm = RMSNorm.Config.sequence_parallel(config.dim, eps=config.norm_eps)
        elif config.use_local_map:
            norm = RMSNorm.Config.local_map(config.dim, eps=config.norm_eps)
        else:
            norm = RMSNorm.Config(dim=config.dim, eps=config.norm_eps)
        self.norm = norm.build()
        self.output = output.build()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)`` of integer ``tokens`` ``(batch, seq)``.

        Once parallelized the logits are a DTensor sharded by vocab (``Shard(-1)``);
        ``.full_tensor()`` gathers them.
        """
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))  # type: ignore[no-any-return]

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (loss parallel over the vocab once parallelized).

        Example::

            >>> model.loss(tokens[:, :-1], tokens[:, 1:]).backward()  # doctest: +SKIP
        """
        return cross_entropy(self(tokens), targets)

    def parallelize(self, mesh: DeviceMesh) -> Llama:
        """Check the head counts divide by the ``tp`` size, then shard (see :meth:`Module.parallelize`).

        Example::

            model = Llama.Config().build().parallelize(init_device_mesh("cpu", (2,),
                                                                       mesh_dim_names=("tp",)))
        """
        names = tuple(mesh.mesh_dim_names or ())
        tp_name = axis_name(MeshAxisName.TP)
        if tp_name in names:
            tp = mesh.size(names.index(tp_name))
            cfg = self.config
            n_kv = cfg.n_kv_heads if cfg.n_kv_heads is not None else cfg.n_heads
            if cfg.n_heads % tp or n_kv % tp:
                raise ValueError(
                    f"Llama.parallelize: n_heads ({cfg.n_heads}) and n_kv_heads ({n_kv}) must "
                    f"divide by the size of mesh axis 'tp' ({tp})"
                )
        super().parallelize(mesh)
        if self.config.compile_local_map:
            compile_local_maps(self)
        return self


def _flavors() -> dict[str, Any]:
    return {
        "debug": Llama.Config(),
        "small": Llama.Config(
            vocab_size=8192,
            dim=512,
            n_layers=4,
            n_heads=8,
            n_kv_heads=4,
            ffn_dim=1536,
            max_seq_len=256,
        ),
    }


#: The reference model's spec: ``get_spec("llama-ref").config("debug").build()``.
def parallelize_llama(model: Llama, mesh: DeviceMesh, job_config: object = None) -> Llama:
    """The spec's ``parallelize_fn``: TP, activation checkpointing, then FSDP (TorchTitan's order).

    The Configs' layouts over ``mesh["tp"]``; then activation checkpointing of every block
    when ``job_config.activation_checkpoint`` (or its ``.mode``) is ``"full"`` or
    ``"selective"``; then, on a mesh with a ``dp_shard`` axis (and ``dp_replicate``), fully
    sharded data parallelism over it (:func:`apply_fsdp`).

    Example::

        model = parallelize_llama(Llama.Config().build(), mesh)
        model = parallelize_llama(Llama.Config().build(), mesh, {"activation_checkpoint": "full"})
    """
    names = tuple(mesh.mesh_dim_names or ())
    tp_name = axis_name(MeshAxisName.TP)
    ac_mode = checkpoint_mode(job_config)  # checked before anything changes
    if tp_name in names:
        model.parallelize(mesh[tp_name] if len(names) > 1 else mesh)
    elif axis_name(MeshAxisName.DP_SHARD) not in names:
        model.parallelize(mesh)
    # TorchTitan's order: TP, activation checkpointing, then FSDP (whose hooks stay outside
    # the checkpointed forward, so the recompute does not unshard twice)
    apply_activation_checkpointing(model.layers, mode=ac_mode)
    apply_fsdp(model, mesh)
    return model


def apply_fsdp(model: Llama, mesh: DeviceMesh) -> Llama:
    """``fully_shard`` over the mesh's ``dp_shard`` (and ``dp_replicate``: HSDP) axes, after TP.

    The units are TorchTitan's: the embeddings, each block, the final norm and the output
    together, then the root. A mesh without a ``dp_shard`` axis leaves the model as it is.

    Example::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        model = parallelize_llama(Llama.Config().build(), mesh)   # TP, then FSDP
    """
    names = tuple(mesh.mesh_dim_names or ())
    shard, replicate = axis_name(MeshAxisName.DP_SHARD), axis_name(MeshAxisName.DP_REPLICATE)
    if shard not in names:
        return model
    hsdp = replicate in names and mesh.size(names.index(replicate)) > 1
    dp_mesh = mesh[(replicate, shard)] if hsdp else mesh[shard]
    fully_shard(model.tok_embeddings, mesh=dp_mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard([model.norm, model.output], mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def _llama_activation(config: Llama.Config) -> NamedPlacement:
    # the residual stream between blocks: split along the sequence with sequence parallelism
    return {MeshAxisName.TP: Shard(1) if config.sequence_parallel else Replicate()}


#: Where llama-ref is cut into pipeline stages: between blocks; the embedding on the first
#: stage, the final norm and the output projection on the last.
LLAMA_PIPELINE_SPLIT = PipelineSplit(
    layers="layers",
    first=("tok_embeddings",),
    last=("norm", "output"),
    activation=_llama_activation,
)


def pipeline_llama(model: Llama, mesh: DeviceMesh, job_config: object = None) -> Pipeline:
    """The spec's ``pipelining_fn``: :func:`~hyper_parallel.dmodule.pipeline.pipeline` with the loss.

    ``job_config["pipeline"]`` (a mapping) may give ``schedule``, ``n_microbatches``
    (default: the ``pp`` size), ``stages_per_rank`` and ``split``.

    Example::

        pipe = pipeline_llama(model, mesh, {"pipeline": {"schedule": "GPipe", "n_microbatches": 4}})
    """
    section = job_config.get("pipeline", {}) if isinstance(job_config, Mapping) else {}
    options = dict(section)
    unknown = sorted(set(options) - {"schedule", "n_microbatches", "stages_per_rank", "split"})
    if unknown:
        raise ValueError(
            f"pipeline_llama: job_config['pipeline'] names {unknown}; expected schedule, "
            f"n_microbatches, stages_per_rank or split"
        )
    options.setdefault("n_microbatches", mesh.size(axis_name(MeshAxisName.PP)))
    return pipeline(model, mesh, loss_fn=cross_entropy, **options)


LLAMA_SPEC = ModelSpec(
    name="llama-ref",
    model=Llama.Config(),
    parallelize_fn=parallelize_llama,
    pipelining_fn=pipeline_llama,
    flavors=_flavors(),
    state_dict_adapter=LlamaStateDictAdapter,
    description="Reference Llama-style decoder (GQA, RoPE, SwiGLU), tensor parallel over 'tp'.",
    pipeline_split=LLAMA_PIPELINE_SPLIT,
)
register_spec(LLAMA_SPEC)
