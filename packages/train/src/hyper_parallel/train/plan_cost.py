"""The planner's step-time estimate: a layout's compute, its collectives over their links, the bubble.

Nothing here measures memory (the dry run does). The estimate, per training step:

- compute: the model's training FLOPs (``Config.get_nparams_and_flops``: 6 per
  non-embedding parameter per token, active experts only, plus attention's sequence
  term), a third more under full activation checkpointing (the forward recomputed),
  spread evenly over the ranks at :data:`MATMUL_EFFICIENCY` of the device's peak
  (half the bfloat16 peak for float32, TF32-class); selective checkpointing recomputes
  no matmul but the element-wise ops, :data:`SELECTIVE_RECOMPUTE` more time;
- each axis's collectives as ring collectives, ``(n - 1) / n`` of the bytes per device
  (twice for an all-reduce), over the link its ranks share: inside a node when the
  group's ranks lie in one node (ranks are laid out row-major over pp, dp_replicate,
  dp_shard, cp, tp, tp fastest), else the network;
- overlap: FSDP's all-gathers and reduce-scatters (and HSDP's all-reduce) run behind
  the compute, so only what exceeds it shows, plus one layer's worth (the first gather,
  the last reduction); tp's, cp's and ep's collectives and the pipeline's sends sit
  between the computations that need them and are not hidden (no async TP);
- the pipeline bubble: ``(pp - 1) / microbatches`` of the pipelined time (1F1B and GPipe;
  interleaved schedules would divide it by the stages per rank, which a job cannot set).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from hyper_parallel.train.config import JobConfig
from hyper_parallel.train.plan_devices import Device

__all__ = [
    "MATMUL_EFFICIENCY",
    "SELECTIVE_RECOMPUTE",
    "Layout",
    "ModelFacts",
    "StepEstimate",
    "estimate_step",
    "model_facts",
]

#: The share of the peak a transformer's matmuls reach in a training step.
MATMUL_EFFICIENCY = 0.6
#: Extra step time of selective activation checkpointing (element-wise ops recomputed).
SELECTIVE_RECOMPUTE = 0.03

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelFacts:
    """What the estimate needs of a model: its size, FLOPs per token and shapes."""

    nparams: int
    #: routed experts' parameters (all experts of all MoE layers); 0 for a dense model
    expert_params: int
    #: training FLOPs per token at the job's sequence length (active experts only)
    flops_per_token: float
    n_layers: int
    moe_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    #: the model has context-parallel attention (a ``cp`` axis can split its sequence)
    context_parallel: bool


def model_facts(config: Any, seq_len: int) -> ModelFacts:
    """Facts of the model ``config`` builds (on the meta device: nothing is allocated).

    Example::

        >>> from hyper_parallel.dmodule.models.llama import Llama
        >>> model_facts(Llama.Config(), 64).nparams
        106816
    """
    from hyper_parallel.dmodule.layers import MoE

    with torch.device("meta"):
        model = config.build()
    nparams, flops = config.get_nparams_and_flops(model, seq_len)
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    experts = sum(p.numel() for m in moe for p in m.experts.parameters())
    n_heads = int(config.n_heads)
    n_kv = getattr(config, "n_kv_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or config.dim // n_heads
    return ModelFacts(
        nparams=int(nparams),
        expert_params=int(experts),
        flops_per_token=float(flops),
        n_layers=int(config.n_layers),
        moe_layers=len(moe),
        dim=int(config.dim),
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        head_dim=int(head_dim),
        num_experts=int(getattr(config, "num_experts", 0) or 0),
        top_k=int(getattr(config, "top_k", 0) or 0),
        context_parallel=hasattr(config, "context_parallel"),
    )


@dataclass(frozen=True)
class Layout:
    """One candidate: the degrees, activation checkpointing, pipeline schedule, batch split.

    ``local_batch_size`` is per data-parallel rank per microstep; with ``pp > 1`` it is the
    whole batch a rank's pipeline splits into ``pipeline_microbatches``.

    Example::

        >>> Layout(dp_shard=8).degrees()["dp_shard"]
        8
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    activation_checkpoint: str = "none"
    pipeline_schedule: str = "1F1B"
    pipeline_microbatches: int = 0
    local_batch_size: int = 1
    gradient_accumulation_steps: int = 1

    def degrees(self) -> dict[str, int]:
        """The ``[parallelism]`` degrees by name."""
        return {
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.cp,
            "tp": self.tp,
            "pp": self.pp,
            "ep": self.ep,
            "etp": self.etp,
        }

    @property
    def world_size(self) -> int:
        """The ranks the layout uses (``ep`` and ``etp`` refactor the others')."""
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        """The ranks that read different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def microbatches(self) -> int:
        """Forward-backward passes per step on a rank: accumulation, or the pipeline's."""
        return self.pipeline_microbatches if self.pp > 1 else self.gradient_accumulation_steps

    def apply(self, job: JobConfig) -> JobConfig:
        """``job`` with this layout's degrees, checkpointing, schedule and batch split.

        Example::

            >>> Layout(tp=2).apply(JobConfig()).parallelism.tp
            2
        """
        parallelism = dataclasses.replace(
            job.parallelism,
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            cp=self.cp,
            tp=self.tp,
            pp=self.pp,
            ep=self.ep,
            etp=self.etp,
            activation_checkpoint=self.activation_checkpoint,  # type: ignore[arg-type]
            pipeline_schedule=self.pipeline_schedule if self.pp > 1 else "1F1B",
            pipeline_microbatches=self.pipeline_microbatches if self.pp > 1 else 0,
        )
        training = dataclasses.replace(
            job.training,
            local_batch_size=self.local_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
        )
        return job.replace(parallelism=parallelism, training=training)

    def describe(self) -> str:
        """The degrees above 1, e.g. ``dp_shard=8 tp=2``, then checkpointing and microbatches."""
        axes = " ".join(f"{k}={v}" for k, v in self.degrees().items() if v > 1) or "one rank"
        extra = f", AC {self.activation_checkpoint}"
        if self.pp > 1:
            extra += f", {self.pipeline_schedule} x{self.pipeline_microbatches} microbatches"
        elif self.gradient_accumulation_steps > 1:
            extra += f", accumulation {self.gradient_accumulation_steps}"
        return axes + extra


@dataclass(frozen=True)
class StepEstimate:
    """A layout's estimated step: seconds, and the parts that made them."""

    seconds: float
    compute_seconds: float
    #: exposed seconds per axis (after the overlap assumed above)
    comm_seconds: dict[str, float]
    bubble: float
    tokens_per_second: float
    mfu: float


def _link(span: int, gpus_per_node: int, device: Device) -> float:
    """Bytes/s of a group whose ranks span ``span`` consecutive ranks (one node, or not)."""
    inside = span <= gpus_per_node and gpus_per_node % span == 0
    return 1e9 * (device.intra_node_gbps if inside else device.inter_node_gbps)


def _ring(n: int) -> float:
    return (n - 1) / n


def estimate_step(
    facts: ModelFacts,
    layout: Layout,
    job: JobConfig,
    device: Device,
    gpus_per_node: int,
) -> StepEstimate:
    """The estimated seconds of one training step of ``job`` under ``layout`` (see the module).

    Example::

        >>> from hyper_parallel.train.plan_devices import DEVICES
        >>> facts = ModelFacts(8_030_261_248, 0, 5.8e10, 32, 0, 4096, 32, 8, 128, 0, 0, True)
        >>> job = JobConfig().apply_overrides(["training.seq_len=8192"])
        >>> estimate_step(facts, Layout(dp_shard=8), job, DEVICES["h100"], 8).seconds > 0
        True
    """
    training = job.training
    tokens = training.global_batch_size * training.seq_len
    world = layout.world_size
    act_bytes = _DTYPE_BYTES[training.param_dtype]
    reduce_bytes = _DTYPE_BYTES[training.reduce_dtype]
    peak = device.peak_tflops * 1e12 * (0.5 if training.param_dtype == "float32" else 1.0)

    flops = facts.flops_per_token * tokens
    work = flops * (4 / 3 if layout.activation_checkpoint == "full" else 1.0)
    compute = work / world / (peak * MATMUL_EFFICIENCY)
    if layout.activation_checkpoint == "selective":
        compute *= 1 + SELECTIVE_RECOMPUTE

    tp, cp, pp, ep, etp = layout.tp, layout.cp, layout.pp, layout.ep, layout.etp
    fsdp = layout.dp_shard * cp
    efsdp = max(1, fsdp * tp // (ep * etp))
    layers = -(-facts.n_layers // pp)
    moe_layers = -(-facts.moe_layers // pp)
    # this rank's share of its stage's weights (tp- or ep-sharded, before FSDP)
    dense = (facts.nparams - facts.expert_params) / (pp * tp)
    experts = facts.expert_params / (pp * ep * etp)
    # the tokens a rank's stage sees per step: its data rank's batch, its cp share
    rank_tokens = training.global_batch_size // layout.dp * training.seq_len / cp
    recompute = layout.activation_checkpoint == "full"
    comm: dict[str, float] = {}

    # -- data parallel: FSDP's gathers and reductions, HSDP's all-reduce (overlapped) ------
    # a pipeline stage keeps its gathered weights over its microbatches (reshard after
    # forward off, as TorchTitan); without one, every microstep gathers and reduces again
    passes = 1 if pp > 1 else layout.gradient_accumulation_steps
    fsdp_bw = _link(tp * fsdp, gpus_per_node, device)
    dp_seconds = 0.0
    if fsdp > 1:
        moved = _ring(fsdp) * dense * (2 * act_bytes + reduce_bytes) * passes
        dp_seconds += moved / fsdp_bw
    if facts.expert_params and efsdp > 1:
        # efsdp ranks: the fsdp ranks (x tp when etp == 1) that hold the same experts
        moved = _ring(efsdp) * experts * (2 * act_bytes + reduce_bytes) * passes
        dp_seconds += moved / _link(tp * fsdp, gpus_per_node, device)
    if layout.dp_replicate > 1:
        shard = dense / fsdp + experts / efsdp
        moved = 2 * _ring(layout.dp_replicate) * shard * reduce_bytes
        dp_seconds += moved / _link(world // pp, gpus_per_node, device)
    if dp_seconds:
        exposed = max(0.0, dp_seconds - compute) + dp_seconds / max(layers, 1)
        comm["dp"] = exposed

    # -- tensor parallel: two reductions of the residual stream per block, each way -------
    if tp > 1:
        per_block = 4 + (2 if recompute else 0)
        moved = layers * per_block * 2 * _ring(tp) * rank_tokens * facts.dim * act_bytes
        comm["tp"] = moved / _link(tp, gpus_per_node, device)
    # -- context parallel: keys and values gathered forward, their gradients reduced -------
    if cp > 1:
        kv = rank_tokens * cp * 2 * facts.n_kv_heads * facts.head_dim / tp * act_bytes
        per_block = 2 + (1 if recompute else 0)
        comm["cp"] = layers * per_block * _ring(cp) * kv / _link(tp * cp, gpus_per_node, device)
    # -- expert parallel: dispatch and combine all-to-alls, forward and backward ----------
    if ep > 1 and moe_layers:
        routed = rank_tokens * facts.top_k * facts.dim * act_bytes
        per_block = 4 + (2 if recompute else 0)
        span = ep if etp == 1 else ep * tp
        comm["ep"] = (
            moe_layers * per_block * _ring(ep) * routed / _link(span, gpus_per_node, device)
        )
    # -- pipeline: activations forward, their gradients back, once per stage boundary -----
    bubble = 0.0
    if pp > 1:
        moved = 2 * rank_tokens * facts.dim * act_bytes
        comm["pp"] = moved / _link(world, gpus_per_node, device)
        bubble = (pp - 1) / layout.pipeline_microbatches

    pipelined = compute + sum(v for k, v in comm.items() if k != "dp")
    seconds = pipelined * (1 + bubble) + comm.get("dp", 0.0)
    return StepEstimate(
        seconds=seconds,
        compute_seconds=compute,
        comm_seconds=comm,
        bubble=bubble,
        tokens_per_second=tokens / seconds,
        mfu=flops / seconds / (world * device.peak_tflops * 1e12),
    )
