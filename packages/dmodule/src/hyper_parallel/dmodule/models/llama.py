"""The reference Llama-style decoder, tensor parallel over ``tp`` as its layers' Configs declare.

Importing this module registers it as the :class:`~hyper_parallel.dmodule.ModelSpec`
``"llama-ref"`` (flavors ``"debug"``, ``"small"``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule._checks import require_positive, require_positive_float
from hyper_parallel.dmodule._forward import compile_local_maps
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
from hyper_parallel.dmodule.types import MeshAxisName, axis_name
from hyper_parallel.dtensor import DeviceMesh

__all__ = ["LLAMA_SPEC", "Llama", "parallelize_llama"]


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
    """The spec's ``parallelize_fn``: the layouts the layers' Configs declare, over ``mesh["tp"]``.

    Example::

        model = parallelize_llama(Llama.Config().build(), mesh)
    """
    del job_config  # the layouts are declared in the Configs
    names = tuple(mesh.mesh_dim_names or ())
    tp_name = axis_name(MeshAxisName.TP)
    return model.parallelize(mesh[tp_name] if len(names) > 1 and tp_name in names else mesh)


LLAMA_SPEC = ModelSpec(
    name="llama-ref",
    model=Llama.Config(),
    parallelize_fn=parallelize_llama,
    flavors=_flavors(),
    state_dict_adapter=LlamaStateDictAdapter,
    description="Reference Llama-style decoder (GQA, RoPE, SwiGLU), tensor parallel over 'tp'.",
)
register_spec(LLAMA_SPEC)
