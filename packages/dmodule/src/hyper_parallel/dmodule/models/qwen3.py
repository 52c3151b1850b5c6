"""The reference Qwen3 / Qwen3-MoE decoder; its parallelism plan is ``qwen3_sharding.py``.

Importing this module registers it as the :class:`~hyper_parallel.dmodule.ModelSpec`
``"qwen3-ref"``: flavors ``"debug"``, ``"debug-moe"``, ``"small"``, ``"small-moe"`` and the
published Qwen3 ``"0.6B"``, ``"1.7B"``, ``"4B"``, ``"8B"``, ``"14B"``, ``"32B"``,
``"30B-A3B"``, ``"235B-A22B"``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule._checks import (
    check_model_input,
    require_positive,
    require_positive_float,
)
from hyper_parallel.dmodule.base_model import BaseModel
from hyper_parallel.dmodule.containers import ModuleList
from hyper_parallel.dmodule.layers import cross_entropy
from hyper_parallel.dmodule.model_spec import ModelSpec, register_spec
from hyper_parallel.dmodule.models._sharding import (
    check_head_sizes,
    check_whole_plan,
    pipeline_with_loss,
)
from hyper_parallel.dmodule.models.qwen3_hf import Qwen3StateDictAdapter, qwen3_config_from_hf
from hyper_parallel.dmodule.models.qwen3_sharding import (
    block_config,
    embedding_config,
    norm_config,
    output_config,
    parallelize_qwen3,
)
from hyper_parallel.dmodule.parallel_dims import ParallelDims
from hyper_parallel.dmodule.pipeline import Pipeline, PipelineSplit
from hyper_parallel.dmodule.types import MeshAxisName, NamedPlacement
from hyper_parallel.dtensor import DeviceMesh, Replicate, Shard

__all__ = ["QWEN3_PIPELINE_SPLIT", "QWEN3_SPEC", "Qwen3", "parallelize_qwen3", "pipeline_qwen3"]


class Qwen3(BaseModel):
    """Token embedding → ``n_layers`` x :class:`Qwen3Block` → RMSNorm → output projection.

    Each block's MLP is a SwiGLU feed-forward, or a mixture of experts where transformers'
    Qwen3-MoE puts one (:meth:`Config.is_moe_layer`: ``decoder_sparse_step`` and
    ``mlp_only_layers``). Its parallelism plan is one file,
    :mod:`~hyper_parallel.dmodule.models.qwen3_sharding`. ``use_local_map`` runs the norms,
    attention (per-head q/k norms included) and the dense feed-forwards on local tensors
    (``compile_local_map`` compiles their local math); ``region_blocks`` (with
    ``use_local_map``) makes each dense block one outer ``local_map`` region, so the
    residual stream, its adds and the norms run as plain local tensors between the block's
    parts. MoE feed-forwards keep their DTensor path, and MoE blocks are never regions.

    Example::

        >>> model = Qwen3.Config(vocab_size=32, dim=16, n_layers=1, n_heads=2, head_dim=8,
        ...                      ffn_dim=32, max_seq_len=8).build()
        >>> model.init_weights()
        >>> tokens = torch.randint(0, 32, (2, 8))
        >>> model(tokens).shape, model.loss(tokens, tokens).ndim
        (torch.Size([2, 8, 32]), 0)
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        """The model's hyperparameters (transformers' names in :func:`~.qwen3_hf.qwen3_config_to_hf`).

        ``head_dim`` None means ``dim / n_heads``; ``num_experts`` 0 makes a dense Qwen3.
        Routing: ``top_k`` experts per token, ``route_norm`` (``norm_topk_prob``); MoE
        blocks where :meth:`is_moe_layer`. Load balancing is off unless asked:
        ``load_balance_coeff`` (aux-loss-free bias) and ``aux_loss_coeff``.

        Example::

            >>> Qwen3.Config(num_experts=4, decoder_sparse_step=2).is_moe_layer(1)
            True
        """

        vocab_size: int = 256
        dim: int = 64
        n_layers: int = 2
        n_heads: int = 4
        n_kv_heads: int | None = 2
        head_dim: int | None = None
        ffn_dim: int = 128
        max_seq_len: int = 64
        norm_eps: float = 1e-6
        rope_theta: float = 1000000.0
        tie_word_embeddings: bool = False  # output.weight is tok_embeddings.weight
        num_experts: int = 0
        top_k: int = 2
        moe_ffn_dim: int = 64
        decoder_sparse_step: int = 1
        mlp_only_layers: tuple[int, ...] = ()
        route_norm: bool = False
        load_balance_coeff: float | None = None
        aux_loss_coeff: float = 0.0
        # norms, attention (its q/k norms included) and dense feed-forward run as local_map
        # regions on local tensors; MoE feed-forwards keep their DTensor path
        use_local_map: bool = False
        compile_local_map: bool = False  # torch.compile the local_map regions' local math
        # each dense block one outer local_map region: norms, attention and feed-forward inner
        # regions, the residual stream plain local tensors between them (needs use_local_map);
        # MoE blocks stay as use_local_map makes them
        region_blocks: bool = False
        sequence_parallel: bool = False
        vocab_parallel: bool = True

        def validate(self) -> None:
            """Sizes that type-check but cannot make a model are a ``ConfigError`` naming the field.

            Example::

                >>> Qwen3.Config(num_experts=4, top_k=5)
                Traceback (most recent call last):
                ...
                hyper_parallel.config.errors.ConfigError: top_k: expected at most num_experts (4), found 5
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
                "decoder_sparse_step",
            )
            require_positive_float(self, "norm_eps", "rope_theta")
            check_head_sizes(self)
            if not isinstance(self.num_experts, int) or self.num_experts < 0:
                raise ConfigError(
                    f"expected an int >= 0 (0: dense), found {self.num_experts!r}",
                    path="num_experts",
                )
            if self.num_experts:
                require_positive(self, "top_k", "moe_ffn_dim")
                if self.top_k > self.num_experts:
                    raise ConfigError(
                        f"expected at most num_experts ({self.num_experts}), found {self.top_k}",
                        path="top_k",
                    )
            if self.compile_local_map and not self.use_local_map:
                raise ConfigError(
                    "expected use_local_map=true with compile_local_map (it compiles the "
                    "local_map regions), found use_local_map=false",
                    path="compile_local_map",
                )
            if self.region_blocks and not self.use_local_map:
                raise ConfigError(
                    "expected use_local_map=true with region_blocks (each dense block becomes "
                    "an outer local_map region whose norms, attention and feed-forward are "
                    "local_map regions), found use_local_map=false",
                    path="region_blocks",
                )
            outside = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
            if outside:
                raise ConfigError(
                    f"expected layer indices in 0..{self.n_layers - 1}, found {outside}",
                    path="mlp_only_layers",
                )

        @classmethod
        def from_hf(cls, directory: str | os.PathLike[str]) -> Qwen3.Config:
            """The Config of a transformers Qwen3 or Qwen3-MoE directory (its ``config.json``).

            Example::

                >>> Qwen3.Config.from_hf("path/to/Qwen3-30B-A3B").num_experts  # doctest: +SKIP
                128
            """
            return qwen3_config_from_hf(cls, directory)

        def is_moe_layer(self, layer: int) -> bool:
            """Whether block ``layer`` holds experts (transformers' ``Qwen3MoeDecoderLayer`` rule).

            Example::

                >>> Qwen3.Config(num_experts=4, mlp_only_layers=(0,)).is_moe_layer(0)
                False
            """
            return (
                self.num_experts > 0
                and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0
            )

        def get_nparams_and_flops(self, model: torch.nn.Module, seq_len: int) -> tuple[int, float]:
            """Parameters and training FLOPs per token (active experts only), attention included.

            Example::

                >>> cfg = Qwen3.Config()
                >>> cfg.get_nparams_and_flops(cfg.build(), 64)[0]
                106880
            """
            nparams, flops = BaseModel.Config.get_nparams_and_flops(self, model, seq_len)
            n_moe = sum(self.is_moe_layer(i) for i in range(self.n_layers))
            inactive = n_moe * (self.num_experts - self.top_k) * 3 * self.dim * self.moe_ffn_dim
            head_dim = self.head_dim if self.head_dim is not None else self.dim // self.n_heads
            attention = 12.0 * self.n_layers * self.n_heads * head_dim * seq_len
            if self.tie_word_embeddings:  # the shared weight is the output projection too
                flops += 6.0 * self.vocab_size * self.dim
            return nparams, flops - 6.0 * inactive + attention

    def __init__(self, config: Qwen3.Config) -> None:
        super().__init__()
        config.validate()
        self.config = config
        # each part's Config, its sharding included, comes from the plan in qwen3_sharding.py
        self.tok_embeddings = embedding_config(config).build()
        self.layers = ModuleList([block_config(config, i).build() for i in range(config.n_layers)])
        self.norm = norm_config(config).build()
        self.output = output_config(config).build()
        if config.tie_word_embeddings:  # one Parameter: TP, FSDP and load_hf keep it one
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)`` of integer ``tokens`` ``(batch, seq)``.

        Once parallelized over ``tp`` the logits are a DTensor sharded by vocab
        (``Shard(-1)``); ``.full_tensor()`` gathers them.
        """
        check_model_input(tokens, where="Qwen3.forward")
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))  # type: ignore[no-any-return]

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over this rank's batch (loss parallel over the vocab).

        Example::

            >>> model.loss(tokens[:, :-1], tokens[:, 1:]).backward()  # doctest: +SKIP
        """
        return cross_entropy(self(tokens), targets)

    def parallelize(self, mesh: DeviceMesh | ParallelDims) -> Qwen3:  # type: ignore[override]
        """The whole plan for ``mesh``: :func:`~.qwen3_sharding.parallelize_qwen3` (the spec's
        ``parallelize_fn``) without a job_config.

        Tensor and expert parallel, compile, then FSDP over the data-parallel axes (the
        routed experts over ``efsdp``), so a :class:`ParallelDims` with data-parallel degrees
        is never half applied. Refused before anything changes: ``cp > 1`` (no context
        parallel attention) and plain replicas (``dp_replicate > 1`` with no FSDP: the
        training step averages those, ``train_step(average_over=...)``).

        Example::

            model = Qwen3.Config(num_experts=4).build().parallelize(ParallelDims(dp_shard=4, ep=2))
        """
        check_whole_plan(mesh, where="Qwen3.parallelize", plan="parallelize_qwen3")
        return parallelize_qwen3(self, mesh)


def _qwen3(**fields: Any) -> Qwen3.Config:
    """A published Qwen3 shape: vocab, head_dim, norm eps, RoPE theta and context of the family."""
    return Qwen3.Config(
        vocab_size=151936,
        head_dim=128,
        max_seq_len=40960,
        norm_eps=1e-6,
        rope_theta=1000000.0,
        **fields,
    )


def _qwen3_moe(**fields: Any) -> Qwen3.Config:
    """A published Qwen3-MoE shape: 128 experts, 8 per token, normalised top-k weights."""
    return _qwen3(num_experts=128, top_k=8, route_norm=True, n_kv_heads=4, **fields)


def _flavors() -> dict[str, Any]:
    """``debug*``/``small*`` to test with; the rest are the published ``config.json`` of
    Qwen3 (0.6B, 1.7B, 4B: tied embeddings) and Qwen3-MoE, field for field."""
    small = Qwen3.Config(
        vocab_size=8192,
        dim=512,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=64,
        ffn_dim=1536,
        max_seq_len=256,
    )
    return {
        "debug": Qwen3.Config(),
        "debug-moe": Qwen3.Config(num_experts=8, top_k=2, moe_ffn_dim=32),
        "small": small,
        "small-moe": small.replace(num_experts=16, top_k=4, moe_ffn_dim=384),
        "0.6B": _qwen3(
            dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072, tie_word_embeddings=True
        ),
        "1.7B": _qwen3(
            dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=6144, tie_word_embeddings=True
        ),
        "4B": _qwen3(
            dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=9728, tie_word_embeddings=True
        ),
        "8B": _qwen3(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288),
        "14B": _qwen3(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_dim=17408),
        "32B": _qwen3(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_dim=25600),
        "30B-A3B": _qwen3_moe(dim=2048, n_layers=48, n_heads=32, ffn_dim=6144, moe_ffn_dim=768),
        "235B-A22B": _qwen3_moe(dim=4096, n_layers=94, n_heads=64, ffn_dim=12288, moe_ffn_dim=1536),
    }


def _qwen3_activation(config: Qwen3.Config) -> NamedPlacement:
    # the residual stream between blocks: split along the sequence with sequence parallelism
    return {MeshAxisName.TP: Shard(1) if config.sequence_parallel else Replicate()}


#: Where qwen3-ref is cut into pipeline stages: between blocks (dense or MoE alike); the
#: embedding on the first stage, the final norm and the output projection on the last.
QWEN3_PIPELINE_SPLIT = PipelineSplit(
    layers="layers",
    first=("tok_embeddings",),
    last=("norm", "output"),
    activation=_qwen3_activation,
)


def pipeline_qwen3(
    model: Qwen3, mesh: DeviceMesh | ParallelDims, job_config: object = None
) -> Pipeline:
    """The spec's ``pipelining_fn``: stages run by torch's schedules, each parallelized by
    :func:`parallelize_qwen3` over ``mesh``'s other axes.

    With a :class:`ParallelDims` the MoE blocks of each stage get the expert view (``ep``,
    ``etp``, ``efsdp`` within the stage's ``pp`` rank); ``update_load_balance(part, dims)``
    on each of ``Pipeline.model_parts`` after the optimizer step moves the biases of that
    stage's MoE blocks from the counts of every microbatch of every data rank.
    ``job_config["pipeline"]`` (a mapping) may give ``schedule``, ``n_microbatches``
    (default: the ``pp`` size), ``stages_per_rank`` and ``split``.

    Example::

        with torch.device("meta"):
            model = Qwen3.Config(num_experts=4, n_layers=4).build()
        pipe = pipeline_qwen3(model, ParallelDims(pp=2, dp_shard=2, ep=2),
                              {"pipeline": {"schedule": "1F1B", "n_microbatches": 4}})
    """
    return pipeline_with_loss(model, mesh, job_config, where="pipeline_qwen3")


#: The reference model's spec: ``get_spec("qwen3-ref").config("debug-moe").build()``.
QWEN3_SPEC = ModelSpec(
    name="qwen3-ref",
    model=Qwen3.Config(),
    parallelize_fn=parallelize_qwen3,
    pipelining_fn=pipeline_qwen3,
    flavors=_flavors(),
    state_dict_adapter=Qwen3StateDictAdapter,
    description=(
        "Reference Qwen3 / Qwen3-MoE decoder (q/k norm, GQA, RoPE, SwiGLU or top-k experts), "
        "equal to transformers'; TP over 'tp', experts over 'ep' (and 'etp'), stages over 'pp'."
    ),
    pipeline_split=QWEN3_PIPELINE_SPLIT,
)
# At import on purpose: users call get_spec("qwen3-ref") after importing this module.
register_spec(QWEN3_SPEC)
