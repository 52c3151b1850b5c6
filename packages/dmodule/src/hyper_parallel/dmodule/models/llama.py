"""The reference Llama-style decoder; its parallelism plan is ``llama_sharding.py``.

Importing this module registers it as the :class:`~hyper_parallel.dmodule.ModelSpec`
``"llama-ref"``: flavors ``"debug"``, ``"small"`` and the published Llama 3.2 ``"1B"``,
``"3B"`` and Llama 3.1 ``"8B"``, ``"70B"``, ``"405B"``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
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
from hyper_parallel.dmodule.context_parallel import (
    CP_ALGORITHMS,
    ContextParallel,
    TokenLayout,
    check_document_ids,
    check_same_over_cp,
    gather_sequence,
    reduce_loss,
)
from hyper_parallel.dmodule.layers import RopeScaling, TransformerBlock, cross_entropy
from hyper_parallel.dmodule.model_spec import ModelSpec, register_spec
from hyper_parallel.dmodule.models._sharding import (
    check_head_sizes,
    check_whole_plan,
    pipeline_with_loss,
)
from hyper_parallel.dmodule.models.llama_hf import LlamaStateDictAdapter, llama_config_from_hf
from hyper_parallel.dmodule.models.llama_sharding import (
    apply_fsdp,
    block_config,
    embedding_config,
    norm_config,
    output_config,
    parallelize_llama,
)
from hyper_parallel.dmodule.parallel_dims import ParallelDims
from hyper_parallel.dmodule.pipeline import (
    PassThrough,
    Pipeline,
    PipelineSplit,
    StageLayers,
)
from hyper_parallel.dmodule.types import MeshAxisName, NamedPlacement
from hyper_parallel.dtensor import DeviceMesh, Replicate, Shard

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

    Its parallelism plan is :mod:`~hyper_parallel.dmodule.models.llama_sharding`, one
    file (over mesh axis ``tp``): vocab-parallel embedding; per block, column-parallel
    ``wq/wk/wv/w1/w3`` and row-parallel ``wo/w2`` (heads and hidden units sharded);
    replicated norms; a column-parallel output whose logits stay sharded by vocab into
    the loss-parallel :func:`~hyper_parallel.dmodule.layers.cross_entropy`. ``use_local_map`` runs
    attention and feed-forward on local tensors (``compile_local_map`` compiles their
    local math with ``torch.compile``); ``region_blocks`` (with ``use_local_map``) makes
    each block one outer ``local_map`` region, so the residual stream, its adds and the
    norms run as plain local tensors between the block's parts; ``sequence_parallel``
    keeps the residual stream split along the sequence between blocks.

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
        rope_scaling: RopeScaling | None = None  # Llama 3.1's "llama3" scaling (None: plain)
        tie_word_embeddings: bool = False  # output.weight is tok_embeddings.weight
        use_rope: bool = True
        use_local_map: bool = False
        compile_local_map: bool = False  # torch.compile the local_map blocks' local math
        # each block one outer local_map region: norms, attention and feed-forward inner
        # regions, the residual stream plain local tensors between them (needs use_local_map)
        region_blocks: bool = False
        sequence_parallel: bool = False
        vocab_parallel: bool = True
        context_parallel: str = "allgather"  # attention over mesh axis cp: allgather|ring|alltoall

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
            if self.context_parallel not in CP_ALGORITHMS:
                raise ConfigError(
                    f"expected context_parallel to be one of {list(CP_ALGORITHMS)}, found "
                    f"{self.context_parallel!r}",
                    path="context_parallel",
                )
            if self.compile_local_map and not self.use_local_map:
                raise ConfigError(
                    "expected use_local_map=true with compile_local_map (it compiles the "
                    "local_map blocks), found use_local_map=false",
                    path="compile_local_map",
                )
            if self.region_blocks and not self.use_local_map:
                raise ConfigError(
                    "expected use_local_map=true with region_blocks (each block becomes an "
                    "outer local_map region whose norms, attention and feed-forward are "
                    "local_map regions), found use_local_map=false",
                    path="region_blocks",
                )
            check_head_sizes(self)
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
            """The Config of every block (:func:`~.llama_sharding.block_config`).

            Example::

                >>> Llama.Config(n_heads=8).block().attention.n_heads
                8
            """
            return block_config(self)

        def get_nparams_and_flops(self, model: torch.nn.Module, seq_len: int) -> tuple[int, float]:
            """Parameters and training FLOPs per token, attention's sequence term included.

            Example::

                >>> cfg = Llama.Config()
                >>> cfg.get_nparams_and_flops(cfg.build(), 64)[0]
                106816
            """
            nparams, flops = BaseModel.Config.get_nparams_and_flops(self, model, seq_len)
            head_dim = self.dim // self.n_heads
            if self.tie_word_embeddings:  # the shared weight is the output projection too
                flops += 6.0 * self.vocab_size * self.dim
            return nparams, flops + 12.0 * self.n_layers * self.n_heads * head_dim * seq_len

    def __init__(self, config: Llama.Config) -> None:
        super().__init__()
        self.config = config
        # each part's Config, its sharding included, comes from the plan in llama_sharding.py
        self.tok_embeddings = embedding_config(config).build()
        block = config.block()
        self.layers = ModuleList([block.build() for _ in range(config.n_layers)])
        self.norm = norm_config(config).build()
        self.output = output_config(config).build()
        if config.tie_word_embeddings:  # one Parameter: TP, FSDP and load_hf keep it one
            self.output.weight = self.tok_embeddings.weight

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        document_ids: torch.Tensor | None = None,
        sequence_shard: bool = False,
    ) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)`` of integer ``tokens`` ``(batch, seq)``.

        ``document_ids`` (``[batch, seq]`` ints from 0, non-decreasing) packs several
        documents in a row: no token attends across a boundary and RoPE positions restart
        at 0 in each document. Once parallelized the logits are a DTensor sharded by
        vocab (``Shard(-1)``); ``.full_tensor()`` gathers them. Under context parallelism
        ``tokens`` is the full sequence on every ``cp`` rank and so are the logits, in the
        original order; ``sequence_shard=True`` returns this rank's tokens' logits only
        (:meth:`layout`'s ``index`` says which), as :meth:`loss` uses them.

        On a pipeline stage (:mod:`~hyper_parallel.dmodule.pipeline`) that does not hold
        the embedding, ``tokens`` is the previous stage's activation, already this rank's
        share of the sequence; ``document_ids`` stays the full ``[batch, seq]`` on every
        stage. A stage's logits stay this rank's share (the pipeline's loss is
        :meth:`output_loss`).
        """
        check_model_input(tokens, where="Llama.forward")
        embeds = not isinstance(self.tok_embeddings, PassThrough)
        layout = self.layout(tokens, document_ids, embedded=not embeds)
        if layout is not None and layout.cp is not None and embeds:
            check_same_over_cp(layout.cp, "Llama", tokens=tokens, document_ids=document_ids)
            tokens = tokens[:, layout.index]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h) if layout is None else layer(h, layout=layout)
        logits: torch.Tensor = self.output(self.norm(h))
        staged = isinstance(self.layers, StageLayers)
        if layout is not None and layout.cp is not None and not (sequence_shard or staged):
            return gather_sequence(logits, layout.cp, layout.order())
        return logits

    def loss(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        *,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mean next-token cross-entropy (loss parallel over the vocab once parallelized).

        Targets ``-100`` are ignored (e.g. at each document's last token). Under context
        parallelism ``tokens``/``targets`` are the full ``[batch, seq]`` on every ``cp``
        rank; each rank scores its own tokens and every rank returns the mean over all
        of them, as one process would.

        Example::

            >>> model.loss(tokens[:, :-1], tokens[:, 1:]).backward()  # doctest: +SKIP
        """
        # through __call__, so that hooks on the model (FSDP's root) see the step
        logits = self(tokens, document_ids=document_ids, sequence_shard=True)
        if self.context_parallel is not None and targets.shape != tokens.shape:
            raise ValueError(
                f"Llama.loss: expected targets of the tokens' shape {list(tokens.shape)}, "
                f"found {list(targets.shape)}"
            )
        return self.output_loss(logits, targets, document_ids=document_ids)

    def output_loss(
        self,
        logits: torch.Tensor,
        targets: torch.Tensor,
        *,
        document_ids: torch.Tensor | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy,
    ) -> torch.Tensor:
        """The mean loss of the logits :meth:`forward` returned with ``sequence_shard=True``.

        ``targets`` (and ``document_ids``) are the full ``[batch, seq]``; ``loss_fn`` is a
        mean over the targets that are not -100. Under context parallelism ``logits`` are
        this rank's tokens': it scores them against their targets, weighted by its share
        of the group's counted targets, and the shares are summed over ``cp``, so every
        rank returns the mean over the whole sequence (the pipeline's last stage calls
        this for each microbatch).

        Example::

            logits = model(tokens, sequence_shard=True)
            loss = model.output_loss(logits, targets)
        """
        layout = self.layout(targets, document_ids)
        if layout is None or layout.cp is None:
            return loss_fn(logits, targets)
        if logits.shape[:2] != (targets.shape[0], layout.index.numel()):
            raise ValueError(
                f"Llama.output_loss: expected this cp rank's logits [batch, seq / cp, ...] = "
                f"{[targets.shape[0], layout.index.numel()]} (forward with sequence_shard=True), "
                f"found {list(logits.shape)}"
            )
        check_same_over_cp(layout.cp, "Llama.loss", targets=targets)
        local_targets = targets[:, layout.index.to(targets.device)]
        total = int((targets != -100).sum())
        count = int((local_targets != -100).sum())
        if count == 0:  # this rank's tokens are all ignored: a zero share, still in the graph
            share = loss_fn(logits, torch.zeros_like(local_targets)) * 0.0
        else:
            share = loss_fn(logits, local_targets) * (count / max(total, 1))
        return reduce_loss(share, layout.cp)

    def check_batch(
        self,
        tokens: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        *,
        document_ids: torch.Tensor | None = None,
    ) -> None:
        """Raise the ``ValueError`` :meth:`forward` or :meth:`loss` would, from what is given.

        ``document_ids`` against the tokens' or targets' shape; under context parallelism,
        the sequence length against ``2 * cp`` chunks. A pipeline stage calls it with what
        its rank holds before the schedule runs, so that every rank refuses a bad batch.

        Example::

            >>> Llama.Config().build().check_batch(
            ...     torch.zeros(1, 4, dtype=torch.long), document_ids=torch.zeros(1, 3, dtype=torch.long))
            Traceback (most recent call last):
            ...
            ValueError: Llama: expected document_ids of shape [batch, seq] = [1, 4] (the tokens' shape), found [1, 3]
        """
        if tokens is not None and targets is not None and targets.shape != tokens.shape:
            raise ValueError(
                f"Llama: expected targets of the tokens' shape {list(tokens.shape)}, found "
                f"{list(targets.shape)}"
            )
        for given in (tokens, targets, document_ids):
            if given is not None:
                self.layout(given, document_ids)

    def layout(
        self,
        tokens: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        *,
        embedded: bool = False,
    ) -> TokenLayout | None:
        """Where ``tokens``' positions sit for attention (``None``: plain causal, whole sequence).

        Checks ``document_ids``; under context parallelism ``index`` holds this rank's
        global positions (head-tail order). ``embedded=True``: ``tokens`` is an activation
        ``(batch, seq_local, dim)`` already cut to this rank's share (a later pipeline
        stage), so the full sequence is ``cp`` times longer.

        Example::

            >>> Llama.Config().build().layout(torch.zeros(1, 4, dtype=torch.long)) is None
            True
        """
        cp = self.context_parallel
        seq = tokens.shape[1] * (cp.size if embedded and cp is not None else 1)
        if document_ids is not None:
            check_document_ids(document_ids, (tokens.shape[0], seq), where="Llama")
        if cp is None and document_ids is None:
            return None
        return TokenLayout.build(seq, document_ids=document_ids, cp=cp, device=tokens.device)

    def parallelize(self, mesh: DeviceMesh | ParallelDims) -> Llama:
        """The whole plan for ``mesh``: :func:`~.llama_sharding.parallelize_llama` (the spec's
        ``parallelize_fn``) without a job_config.

        Tensor and context parallel, compile, then FSDP over the data-parallel axes
        (``dp_shard`` x ``cp``, with ``dp_replicate``: HSDP), so a :class:`ParallelDims` with
        data-parallel degrees is never half applied. Plain replicas (``dp_replicate > 1``
        with no FSDP) are refused: their gradients are averaged by the training step
        (``train_step(average_over=...)``, hp-train), not by the model. Everything is
        checked before anything changes; an initialised model keeps its values.

        Example::

            model = Llama.Config().build().parallelize(ParallelDims(dp_shard=2, tp=2))
        """
        check_whole_plan(mesh, where="Llama.parallelize", plan="parallelize_llama")
        return parallelize_llama(self, mesh)

    #: The ``cp`` axis the sequence is split over (``None``: not context parallel).
    context_parallel: ContextParallel | None = None


def _llama3(**fields: Any) -> Llama.Config:
    """A published Llama 3.x shape: vocab, norm eps, RoPE theta and context of the family."""
    return Llama.Config(
        vocab_size=128256,
        n_kv_heads=8,
        max_seq_len=131072,
        norm_eps=1e-5,
        rope_theta=500000.0,
        **fields,
    )


def _flavors() -> dict[str, Any]:
    """``debug``/``small`` to test with; the rest are the published ``config.json`` of Meta's
    Llama 3.2 (1B, 3B: tied embeddings, RoPE scaling factor 32) and Llama 3.1 (8B, 70B,
    405B: factor 8), field for field."""
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
        "1B": _llama3(
            dim=2048,
            n_layers=16,
            n_heads=32,
            ffn_dim=8192,
            rope_scaling=RopeScaling(factor=32.0),
            tie_word_embeddings=True,
        ),
        "3B": _llama3(
            dim=3072,
            n_layers=28,
            n_heads=24,
            ffn_dim=8192,
            rope_scaling=RopeScaling(factor=32.0),
            tie_word_embeddings=True,
        ),
        "8B": _llama3(
            dim=4096, n_layers=32, n_heads=32, ffn_dim=14336, rope_scaling=RopeScaling(factor=8.0)
        ),
        "70B": _llama3(
            dim=8192, n_layers=80, n_heads=64, ffn_dim=28672, rope_scaling=RopeScaling(factor=8.0)
        ),
        "405B": _llama3(
            dim=16384,
            n_layers=126,
            n_heads=128,
            ffn_dim=53248,
            rope_scaling=RopeScaling(factor=8.0),
        ),
    }


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


def pipeline_llama(
    model: Llama, mesh: DeviceMesh | ParallelDims, job_config: object = None
) -> Pipeline:
    """The spec's ``pipelining_fn``: :func:`~hyper_parallel.dmodule.pipeline.pipeline` with the loss.

    ``job_config["pipeline"]`` (a mapping) may give ``schedule``, ``n_microbatches``
    (default: the ``pp`` size), ``stages_per_rank`` and ``split``.

    Example::

        pipe = pipeline_llama(model, mesh, {"pipeline": {"schedule": "GPipe", "n_microbatches": 4}})
    """
    return pipeline_with_loss(model, mesh, job_config, where="pipeline_llama")


#: The reference model's spec: ``get_spec("llama-ref").config("debug").build()``.
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
# At import on purpose: upstream's users call get_spec("llama-ref") after importing this module.
register_spec(LLAMA_SPEC)
