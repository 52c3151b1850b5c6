"""The demo's ParallelDims layouts: ``qwen3-moe`` expert parallelism, ``llama-ref`` context parallelism.

``python -m hyper_parallel.dmodule.demo --model qwen3-moe --ep 2`` or ``--cp 2`` picks
these; every rank builds its meshes from one :class:`ParallelDims`, trains with the
shared ``train_step``, and reports what the layout does (the experts' load and
all-to-alls; a block's activation bytes per rank and the cp collectives). Parity is the
demo's: every step's loss against one process on the same seed and data.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hyper_parallel.dmodule.context_parallel import CP_ALGORITHMS
from hyper_parallel.dmodule.layers.moe import MoE
from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dmodule.models.llama_sharding import parallelize_llama
from hyper_parallel.dmodule.models.qwen3 import Qwen3
from hyper_parallel.dmodule.models.qwen3_sharding import parallelize_qwen3
from hyper_parallel.dmodule.models.training import synthetic_batch, train_step
from hyper_parallel.dmodule.parallel_dims import ParallelDims
from hyper_parallel.dtensor import DTensor, FallbackWarning, collectives, init_device_mesh
from hyper_parallel.platform import get_platform

if TYPE_CHECKING:
    from hyper_parallel.dmodule.demo import Options, RankReport

__all__ = [
    "MODELS",
    "add_layout_arguments",
    "fill_dp_shard_for_ep",
    "layout_problems",
    "packed_document_ids",
    "parallel_dims",
    "split_model_choice",
    "train_layout_rank",
    "train_layout_reference",
    "uses_layouts",
]

#: The demo's models: llama-ref (dense; ``--cp``) and a Qwen3-MoE built from the same fields.
MODELS = ("llama-ref", "qwen3-moe")

Batch = tuple[torch.Tensor, ...]


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--ep``, ``--experts``, ``--cp``, ``--cp-attention`` and ``--packed``."""
    parser.add_argument(
        "--model",
        dest="model_name",
        default="llama-ref",
        choices=MODELS,
        help="llama-ref (default) or qwen3-moe: Qwen3 with --experts routed experts per block, "
        "its sizes from the --model.<field> values",
    )
    parser.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size (qwen3-moe; from dp-shard x tp)"
    )
    parser.add_argument(
        "--experts", type=int, default=8, help="routed experts per block (qwen3-moe; default 8)"
    )
    parser.add_argument(
        "--cp", type=int, default=1, help="context-parallel size: the sequence split (llama-ref)"
    )
    parser.add_argument(
        "--cp-attention",
        default="allgather",
        choices=CP_ALGORITHMS,
        help="attention across the cp ranks (default allgather)",
    )
    parser.add_argument(
        "--packed",
        action="store_true",
        help="pack random-length documents per row (document_ids): no attention across them",
    )


def split_model_choice(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(argv without "--model NAME", that option)``: ``--model.<field>`` belongs to hp-config.

    Example::

        >>> split_model_choice(["--model", "qwen3-moe", "--model.dim=32"])
        (['--model.dim=32'], ['--model', 'qwen3-moe'])
    """
    rest: list[str] = []
    choice: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--model":
            choice = [arg, next(args, "")]
        elif arg.startswith("--model="):
            choice = ["--model", arg.partition("=")[2]]
        else:
            rest.append(arg)
    return rest, choice


def uses_layouts(options: Options) -> bool:
    """Whether the run takes this module's path (qwen3-moe, ``--cp`` or ``--packed``)."""
    return options.model_name != "llama-ref" or options.cp > 1 or options.packed


def fill_dp_shard_for_ep(args: argparse.Namespace) -> None:
    """``--ep`` without ``--dp-shard``: take ``dp_shard = ep / gcd(ep, tp)`` ranks for it.

    Example::

        >>> args = argparse.Namespace(model_name="qwen3-moe", ep=4, tp=2, dp_shard=1, cp=1)
        >>> fill_dp_shard_for_ep(args); args.dp_shard
        2
    """
    if args.model_name == "qwen3-moe" and args.ep > 1 and args.dp_shard == 1 and args.cp == 1:
        args.dp_shard = args.ep // math.gcd(args.ep, max(args.tp, 1))


def layout_problems(args: argparse.Namespace, model: Llama.Config) -> list[str]:
    """What is wrong with ``--model qwen3-moe``, ``--ep``, ``--cp`` and how they compose."""
    if args.ep < 1 or args.cp < 1 or args.experts < 1:
        return [
            f"--ep, --cp and --experts must be >= 1 (found {args.ep}, {args.cp}, {args.experts})"
        ]
    moe = args.model_name == "qwen3-moe"
    if not (moe or args.cp > 1 or args.packed or args.ep > 1):
        return []
    problems: list[str] = []
    if args.ep > 1 and not moe:
        problems.append("--ep needs --model qwen3-moe (llama-ref has no experts)")
    if moe and args.cp > 1:
        problems.append("--cp needs --model llama-ref (Qwen3Attention has no context parallelism)")
    if moe and args.experts % args.ep:
        problems.append(f"--experts {args.experts} must divide by --ep {args.ep}")
    unsupported = [
        flag
        for flag, on in (
            ("--pp", args.pp > 1),
            ("--dp", args.dp > 1),
            ("--dp-replicate", args.dp_replicate > 1),
            ("--checkpoint-dir", args.checkpoint_dir is not None),
            ("--resume", args.resume),
        )
        if on
    ]
    if unsupported:
        problems.append(
            f"{', '.join(unsupported)} do not compose with --model qwen3-moe, --cp or --packed "
            "yet (--tp and --dp-shard do)"
        )
    if args.seq_len % (2 * args.cp):
        problems.append(
            f"--seq-len {args.seq_len} must divide by 2 x --cp = {2 * args.cp} (head-tail chunks)"
        )
    if args.cp > 1 and args.cp_attention == "alltoall":
        # checked by Llama.parallelize too; here, before any rank starts
        n_kv = model.n_kv_heads if model.n_kv_heads is not None else model.n_heads
        if (n_kv // max(args.tp, 1)) % args.cp:
            problems.append(
                f"--cp-attention alltoall needs the key/value heads per tp rank (--model."
                f"n_kv_heads {n_kv} / --tp {args.tp}) to divide by --cp {args.cp}"
            )
    world = args.dp_shard * args.cp * args.tp
    try:
        ParallelDims(dp_shard=args.dp_shard, cp=args.cp, tp=args.tp, ep=args.ep, world_size=world)
    except ValueError as error:
        problems.append(f"--dp-shard/--cp/--tp/--ep: {error}")
    return problems


def parallel_dims(options: Options) -> ParallelDims:
    """The run's degrees (``tp`` x ``cp`` x ``dp_shard`` ranks; ``ep`` borrowed from them).

    Example::

        >>> parallel_dims(parse_args(["--model", "qwen3-moe", "--ep", "2"])).ep  # doctest: +SKIP
        2
    """
    return ParallelDims(
        dp_shard=options.dp_shard,
        cp=options.cp,
        tp=options.tp,
        ep=options.ep,
        world_size=options.dp_shard * options.cp * options.tp,
    )


def _qwen3_config(options: Options) -> Qwen3.Config:
    """qwen3-moe: llama-ref's sizes, ``--experts`` routed experts (top 2) in every block."""
    cfg = options.model
    return Qwen3.Config(
        vocab_size=cfg.vocab_size,
        dim=cfg.dim,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        ffn_dim=cfg.ffn_dim,
        max_seq_len=cfg.max_seq_len,
        num_experts=options.experts,
        top_k=min(2, options.experts),
        moe_ffn_dim=max(cfg.ffn_dim // 2, 1),
        # distinct tokens on each tp rank, so that ep may borrow tp's ranks
        sequence_parallel=options.tp > 1,
    )


def _build(options: Options) -> Llama | Qwen3:
    if options.model_name == "qwen3-moe":
        return Qwen3(_qwen3_config(options))
    return Llama(options.model.replace(context_parallel=options.cp_attention))


def packed_document_ids(step: int, *, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """``[batch, seq]`` document ids of rows packed with 1-4 random-length documents.

    Every rank draws the same ids for a step (a generator seeded by ``seed`` and ``step``).

    Example::

        >>> ids = packed_document_ids(1, batch_size=2, seq_len=8, seed=0)
        >>> ids.shape, bool((ids.diff(dim=1) >= 0).all())
        (torch.Size([2, 8]), True)
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step + 7_919)
    rows = []
    for _ in range(batch_size):
        documents = int(torch.randint(1, 5, (), generator=generator))
        cuts = torch.randperm(seq_len - 1, generator=generator)[: documents - 1] + 1
        starts = torch.zeros(seq_len, dtype=torch.long)
        starts[cuts] = 1
        rows.append(starts.cumsum(0))
    return torch.stack(rows)


def _batch(options: Options, step: int) -> Batch:
    """The step's global batch: tokens, targets (and document ids with ``--packed``)."""
    tokens, targets = synthetic_batch(
        step,
        batch_size=options.batch_size,
        seq_len=options.seq_len,
        vocab_size=options.model.vocab_size,
        seed=options.seed,
    )
    if not options.packed:
        return tokens, targets
    ids = packed_document_ids(
        step, batch_size=options.batch_size, seq_len=options.seq_len, seed=options.seed
    )
    return tokens, targets, ids


def train_layout_reference(options: Options) -> list[float]:
    """The same training in one process: full model, full batch, same seed and data."""
    device = get_platform().device_for(options.device) if options.device != "cpu" else None
    if device is None:
        torch.set_num_threads(1)
    torch.manual_seed(options.seed)
    model = _build(options)
    if device is not None:
        model.to(device)
    model.init_weights(buffer_device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.lr, foreach=False)
    losses = []
    for step in range(1, options.steps + 1):
        batch = tuple(t.to(device or "cpu") for t in _batch(options, step))
        losses.append(train_step(model, [batch], optimizer).loss)
    return losses


def train_layout_rank(options: Options) -> RankReport | None:
    """One rank of a ``--model qwen3-moe`` / ``--cp`` / ``--packed`` run; rank 0 reports.

    Example::

        >>> run_distributed(train_layout_rank, 2, args=(parse_args(["--cp", "2"]),))  # doctest: +SKIP
    """
    from hyper_parallel.dmodule.demo import (
        RankReport,
        _print_step,
        count_collectives,
        sharding_plan,
    )

    platform = get_platform()
    rank = platform.get_rank()
    device = platform.device_for(options.device)
    dims = parallel_dims(options)
    dims.build_mesh(options.device)
    with torch.device("meta"):
        model = _build(options)
    if isinstance(model, Qwen3):
        parallelize_qwen3(model, dims)
    else:
        parallelize_llama(model, dims)
    model.to_empty(device=device)
    torch.manual_seed(options.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # as in the demo's train_rank
        model.init_weights(buffer_device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.lr, foreach=False)
    batch_mesh = dims.batch_mesh
    dp_rank, dp_size = batch_mesh.get_local_rank("batch"), batch_mesh.size()
    rows = slice(
        dp_rank * options.batch_size // dp_size, (dp_rank + 1) * options.batch_size // dp_size
    )
    routed = _count_routed_tokens(model)
    block_bytes = _first_block_output_bytes(model)
    layout_axis = "ep" if isinstance(model, Qwen3) else "cp"
    axis_counts: dict[str, list[int]] = {}  # kind -> [count, bytes] on layout_axis, step 1
    losses: list[float] = []
    seconds: list[float] = []
    counts: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for step in range(1, options.steps + 1):
        start = time.perf_counter()
        # every cp and tp rank gets its batch rows' full sequences; the model splits them
        batch = tuple(t[rows].to(device) for t in _batch(options, step))
        step_counts: Counter[str] = Counter()
        with (
            count_collectives(step_counts, nbytes if step == 1 else Counter()),
            collectives.observe_collectives(_on_axis(layout_axis, axis_counts, step == 1)),
        ):
            result = train_step(
                model, [batch], optimizer, loss_mesh=batch_mesh, loss_axes=("batch",)
            )
        seconds.append(time.perf_counter() - start)
        losses.append(result.loss)
        if step == 1:
            counts = step_counts
        if rank == 0:
            _print_step(step, options.steps, losses[-1], seconds[-1])
    sections = (
        _moe_section(options, dims, model, routed, axis_counts)
        if isinstance(model, Qwen3)
        else _cp_section(options, block_bytes, axis_counts)
    )
    if rank != 0:
        return None
    return RankReport(
        losses,
        sharding_plan(model),
        {k: (counts[k], nbytes[k]) for k in counts},
        seconds,
        sections=sections,
    )


def _on_axis(
    axis: str, seen: dict[str, list[int]], record: bool
) -> Callable[[collectives.CollectiveRecord], None]:
    """An observer that adds each collective over ``axis`` to ``seen`` (when ``record``)."""

    def observer(event: collectives.CollectiveRecord) -> None:
        if record and event.mesh_axis == axis:
            entry = seen.setdefault(event.kind, [0, 0])
            entry[0] += 1
            entry[1] += event.nbytes

    return observer


def _axis_lines(seen: dict[str, list[int]]) -> list[str]:
    lines = [
        f"    {kind:<15} x{count:<4} {size / 1024:9.1f} KiB"
        for kind, (count, size) in sorted(seen.items())
    ]
    return lines or ["    none"]


def _count_routed_tokens(model: torch.nn.Module) -> list[torch.Tensor]:
    """Per MoE block, a tensor that its router's hook adds this rank's tokens per expert to."""
    totals: list[torch.Tensor] = []
    for module in model.modules():
        if isinstance(module, MoE):
            total = torch.zeros(module.config.num_experts, dtype=torch.long)
            totals.append(total)
            module.router.register_forward_hook(_add_counts(total))
    return totals


def _add_counts(total: torch.Tensor) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: object, output: tuple[torch.Tensor, ...]) -> None:
        experts = output[1]  # (weights, experts, probs): each token's top-k expert indices
        local = experts.to_local() if isinstance(experts, DTensor) else experts
        total.add_(torch.bincount(local.reshape(-1).cpu(), minlength=total.numel()))

    return hook


def _first_block_output_bytes(model: Llama | Qwen3) -> list[int]:
    """A one-item list that the first block's forward sets to its output's local bytes."""
    seen = [0]

    def hook(module: torch.nn.Module, args: object, output: torch.Tensor) -> None:
        local = output.to_local() if isinstance(output, DTensor) else output
        seen[0] = local.numel() * local.element_size()

    model.layers[0].register_forward_hook(hook)
    return seen


def _gather_ints(values: list[int], options: Options) -> list[list[int]]:
    """Every rank's ``values``, in rank order (one all-gather over all ranks)."""
    world = options.dp_shard * options.cp * options.tp
    device = get_platform().device_for(options.device)
    everyone = init_device_mesh(options.device, (world,))
    mine = torch.tensor(values, dtype=torch.long, device=device)
    return [[int(v) for v in row] for row in collectives.all_gather(mine, everyone, 0).tolist()]


def _moe_section(
    options: Options,
    dims: ParallelDims,
    model: Qwen3,
    routed: list[torch.Tensor],
    on_ep: dict[str, list[int]],
) -> list[str]:
    """Tokens per expert and per rank, each rank's share of the expert weights, all-to-alls."""
    experts_per_rank = options.experts // options.ep
    ep_rank = dims.get_mesh("ep").get_local_rank("ep") if dims.ep > 1 else 0
    mine = slice(ep_rank * experts_per_rank, (ep_rank + 1) * experts_per_rank)
    local_total = torch.stack(routed).sum(0)  # this rank's tokens, every block
    # the tokens this rank's experts computed: its ep group's tokens routed to them
    group = local_total.to(get_platform().device_for(options.device))
    if dims.ep > 1:
        group = collectives.all_reduce(group, dims.get_mesh("ep"), "ep", "sum")
    load = int(group[mine].sum())
    expert_params = [
        p for name, p in model.named_parameters() if ".feed_forward.experts." in f".{name}"
    ]
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in expert_params)
    full = sum(p.numel() for p in expert_params)
    rows = _gather_ints([*local_total.tolist(), load, held], options)
    per_expert = [sum(row[e] for row in rows) for e in range(options.experts)]
    lines = [
        f"experts (qwen3-moe, {options.experts} per block, top-{min(2, options.experts)}; "
        f"ep={options.ep}: {experts_per_rank} per rank; tp={options.tp} dp_shard="
        f"{options.dp_shard}):",
        f"  tokens per expert (all {options.steps} steps, all blocks, all ranks): {per_expert}",
        "  tokens per rank (routed to the experts it holds, from its ep group):",
    ]
    for r, row in enumerate(rows):
        lines.append(
            f"    rank {r}: {row[options.experts]:6d} tokens   expert weights {row[-1]:7d} of "
            f"{full} ({row[-1] / max(full, 1):.3f}; ep={dims.ep} efsdp={dims.efsdp})"
        )
    lines.append("  collectives over 'ep' per training step (rank 0; dispatch, combine, backward):")
    return lines + _axis_lines(on_ep)


def _cp_section(options: Options, block_bytes: list[int], on_cp: dict[str, list[int]]) -> list[str]:
    """One block's activation bytes per rank, against one process's; the cp collectives."""
    cfg = options.model
    one_process = options.batch_size * options.seq_len * cfg.dim * 4  # float32 [b, s, dim]
    rows = _gather_ints(block_bytes, options)
    split = options.dp_shard * options.cp * (options.tp if cfg.sequence_parallel else 1)
    lines = [
        f"context parallelism (cp={options.cp}, {options.cp_attention} attention"
        + (", packed documents" if options.packed else "")
        + f"; tp={options.tp} dp_shard={options.dp_shard}):",
        f"  one block's output activations per rank (one process: {one_process / 1024:.1f} KiB):",
    ]
    for r, (size,) in enumerate(rows):
        lines.append(
            f"    rank {r}: {size / 1024:8.1f} KiB  ({size / one_process:.3f} of one process; "
            f"1 / (dp_shard x cp{' x tp' if cfg.sequence_parallel else ''}) = {1 / split:.3f})"
        )
    lines.append(f"  collectives over 'cp' per training step (rank 0; {options.cp_attention}):")
    return lines + _axis_lines(on_cp)
