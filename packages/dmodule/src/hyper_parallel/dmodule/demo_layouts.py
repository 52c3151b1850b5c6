"""The demo's ParallelDims layouts: ``qwen3-moe`` expert parallelism, ``llama-ref`` context parallelism.

``python -m hyper_parallel.dmodule.demo --model qwen3-moe --ep 2`` or ``--cp 2`` picks
these; every rank builds its meshes from one :class:`ParallelDims`, parallelizes the model
with its spec's ``parallelize_fn`` (with ``--pp``: cuts it into stages with the spec's
``pipelining_fn``), trains with the shared ``train_step``, and reports what the layout does
(the experts' load and all-to-alls; a block's activation bytes per rank and the cp
collectives; with ``--pp`` each rank's numbers are its stage's). Parity is the demo's:
every step's loss against one process on the same seed and data.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings
from collections import Counter
from collections.abc import Callable

import torch

from hyper_parallel.dmodule.context_parallel import CP_ALGORITHMS
from hyper_parallel.dmodule.demo_options import Options, RankReport, stages_per_rank
from hyper_parallel.dmodule.demo_report import count_collectives, print_step, sharding_plan
from hyper_parallel.dmodule.layers.moe import MoE
from hyper_parallel.dmodule.model_spec import ModelSpec, get_spec
from hyper_parallel.dmodule.models.llama import Llama
from hyper_parallel.dmodule.models.qwen3 import Qwen3
from hyper_parallel.dmodule.models.training import synthetic_batch, train_step
from hyper_parallel.dmodule.parallel_dims import ParallelDims
from hyper_parallel.dmodule.pipeline import Pipeline, stage_owner
from hyper_parallel.dtensor import DTensor, FallbackWarning, collectives, init_device_mesh
from hyper_parallel.platform import get_platform

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
            "yet (--tp, --dp-shard and --pp do)"
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
    world = args.pp * args.dp_shard * args.cp * args.tp
    try:
        ParallelDims(
            dp_shard=args.dp_shard, cp=args.cp, tp=args.tp, pp=args.pp, ep=args.ep, world_size=world
        )
    except ValueError as error:
        problems.append(f"--dp-shard/--cp/--tp/--pp/--ep: {error}")
    return problems


def parallel_dims(options: Options) -> ParallelDims:
    """The run's degrees (``pp`` x ``dp_shard`` x ``cp`` x ``tp`` ranks; ``ep`` borrowed from
    ``dp_shard`` x ``cp`` x ``tp`` within each ``pp`` rank).

    Example::

        >>> parallel_dims(parse_args(["--model", "qwen3-moe", "--ep", "2"])).ep  # doctest: +SKIP
        2
    """
    return ParallelDims(
        dp_shard=options.dp_shard,
        cp=options.cp,
        tp=options.tp,
        pp=options.pp,
        ep=options.ep,
        world_size=options.world,
    )


def _spec(options: Options) -> ModelSpec:
    """The registered spec whose ``parallelize_fn`` / ``pipelining_fn`` the run uses."""
    return get_spec("qwen3-ref" if options.model_name == "qwen3-moe" else "llama-ref")


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

    With ``--pp`` the model is cut by its spec's ``pipelining_fn`` and this rank trains
    its stages (each parallelized over the other axes) through the same ``train_step``.

    Example::

        >>> run_distributed(train_layout_rank, 2, args=(parse_args(["--cp", "2"]),))  # doctest: +SKIP
    """
    platform = get_platform()
    rank = platform.get_rank()
    device = platform.device_for(options.device)
    dims = parallel_dims(options)
    dims.build_mesh(options.device)
    with torch.device("meta"):
        model = _build(options)
    spec = _spec(options)
    trained: torch.nn.Module | Pipeline = model
    parts: list[torch.nn.Module] = [model]
    if options.pp > 1:
        assert spec.pipelining_fn is not None  # both specs declare one
        pipeline_options = {
            "schedule": options.schedule,
            "n_microbatches": options.microbatches,
            "stages_per_rank": stages_per_rank(options.schedule),
        }
        pipe: Pipeline = spec.pipelining_fn(model, dims, {"pipeline": pipeline_options})
        trained, parts = pipe, pipe.model_parts
    else:
        assert spec.parallelize_fn is not None  # both specs declare one
        spec.parallelize_fn(model, dims, None)
        model.to_empty(device=device)
    torch.manual_seed(options.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # as in the demo's train_rank
        trained.init_weights(buffer_device=device)  # type: ignore[operator]
    params = [p for part in parts for p in part.parameters()]
    optimizer = torch.optim.AdamW(params, lr=options.lr, foreach=False)
    batch_mesh = dims.batch_mesh
    dp_rank, dp_size = batch_mesh.get_local_rank("batch"), batch_mesh.size()
    rows = slice(
        dp_rank * options.batch_size // dp_size, (dp_rank + 1) * options.batch_size // dp_size
    )
    microbatches = options.microbatches if options.pp > 1 else 1
    routed = _RoutedTokens(parts, microbatches)
    # a pipeline's first step also runs torch's metadata inference: count a later one
    counted = 2 if options.pp > 1 and options.steps > 1 else 1
    block_bytes = _first_block_output_bytes(parts[0])
    layout_axis = "ep" if isinstance(model, Qwen3) else "cp"
    axis_counts: dict[str, list[int]] = {}  # kind -> [count, bytes] on layout_axis, one step
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
            count_collectives(step_counts, nbytes if step == counted else Counter()),
            collectives.observe_collectives(_on_axis(layout_axis, axis_counts, step == counted)),
        ):
            # with --pp: the last stage's loss, broadcast over pp, then averaged over batch
            result = train_step(
                trained,
                [batch],
                optimizer,
                loss_mesh=batch_mesh,
                loss_axes=("batch",),
                pp_mesh=dims.world_mesh if options.pp > 1 else None,
            )
        routed.end_step()
        seconds.append(time.perf_counter() - start)
        losses.append(result.loss)
        if step == counted:
            counts = step_counts
        if rank == 0:
            print_step(step, options.steps, losses[-1], seconds[-1])
    sections = (
        _moe_section(options, dims, parts, routed, axis_counts)
        if isinstance(model, Qwen3)
        else _cp_section(options, block_bytes, axis_counts)
    )
    if rank != 0:
        return None
    return RankReport(
        losses,
        [row for part in parts for row in sharding_plan(part)],
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


class _RoutedTokens:
    """This rank's tokens per expert, summed over its MoE blocks, counted step by step.

    A router runs once per microbatch of a step; on a pipeline's first step torch's
    metadata inference runs each stage once more first, on stand-in inputs. So only a
    step's last ``microbatches`` runs of each router count.
    """

    def __init__(self, parts: list[torch.nn.Module], microbatches: int) -> None:
        self.microbatches = microbatches
        self.runs: list[list[torch.Tensor]] = []  # per router: this step's bincounts
        self.total: torch.Tensor | None = None
        for module in (m for part in parts for m in part.modules()):
            if isinstance(module, MoE):
                runs: list[torch.Tensor] = []
                self.runs.append(runs)
                module.router.register_forward_hook(_add_counts(runs, module.config.num_experts))

    def end_step(self) -> None:
        """Add this step's counted runs to :attr:`total`."""
        for runs in self.runs:
            for counts in runs[-self.microbatches :]:
                self.total = counts if self.total is None else self.total + counts
            runs.clear()


def _add_counts(runs: list[torch.Tensor], num_experts: int) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: object, output: tuple[torch.Tensor, ...]) -> None:
        experts = output[1]  # (weights, experts, probs): each token's top-k expert indices
        local = experts.to_local() if isinstance(experts, DTensor) else experts
        runs.append(torch.bincount(local.reshape(-1).cpu(), minlength=num_experts))

    return hook


def _first_block_output_bytes(part: torch.nn.Module) -> list[int]:
    """``[bytes, index]``: the first block of ``part`` (a model or a stage) and its index; its
    forward sets the bytes to its output's local bytes (the last microbatch's, with ``--pp``)."""
    layers = part.layers
    assert isinstance(layers, torch.nn.Module)
    name, block = next(iter(layers.named_children()))  # a stage's blocks keep their indices
    seen = [0, int(name)]

    def hook(module: torch.nn.Module, args: object, output: torch.Tensor) -> None:
        local = output.to_local() if isinstance(output, DTensor) else output
        seen[0] = local.numel() * local.element_size()

    block.register_forward_hook(hook)
    return seen


def _stages_of(options: Options, rank: int) -> list[int]:
    """The pipeline stages ``rank`` holds (``pp`` is the world mesh's outermost axis)."""
    if options.pp == 1:
        return [0]
    pp_rank = rank // (options.world // options.pp)
    stages = options.pp * stages_per_rank(options.schedule)
    return [s for s in range(stages) if stage_owner(s, options.pp, options.schedule) == pp_rank]


def _stage_label(options: Options, rank: int) -> str:
    """`` (stage 1)`` with ``--pp`` (`` (stages 0, 3)`` for two per rank); empty without."""
    if options.pp == 1:
        return ""
    stages = _stages_of(options, rank)
    return f" (stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))})"


def _pipeline_note(options: Options) -> str:
    """Which stage and step rank 0's collectives are from, with ``--pp``."""
    if options.pp == 1:
        return ""
    step = "step 2 (step 1 adds torch's metadata inference)" if options.steps > 1 else "step 1"
    return f", {_stage_label(options, 0).strip(' ()')}'s blocks, {step}"


def _gather_ints(values: list[int], options: Options) -> list[list[int]]:
    """Every rank's ``values``, in rank order (one all-gather over all ranks)."""
    device = get_platform().device_for(options.device)
    everyone = init_device_mesh(options.device, (options.world,))
    mine = torch.tensor(values, dtype=torch.long, device=device)
    return [[int(v) for v in row] for row in collectives.all_gather(mine, everyone, 0).tolist()]


def _moe_section(
    options: Options,
    dims: ParallelDims,
    parts: list[torch.nn.Module],
    routed: _RoutedTokens,
    on_ep: dict[str, list[int]],
) -> list[str]:
    """Tokens per expert and per rank, each rank's share of the expert weights, all-to-alls.

    With ``--pp`` a rank routes and holds only its stages' MoE blocks: the tokens per
    expert are also shown per stage, and a rank's expert weights against its stages'.
    """
    experts_per_rank = options.experts // options.ep
    ep_rank = dims.get_mesh("ep").get_local_rank("ep") if dims.ep > 1 else 0
    mine = slice(ep_rank * experts_per_rank, (ep_rank + 1) * experts_per_rank)
    local_total = routed.total  # this rank's tokens, every block it holds
    assert local_total is not None  # every stage of qwen3-moe has MoE blocks
    # the tokens this rank's experts computed: its ep group's tokens routed to them
    group = local_total.to(get_platform().device_for(options.device))
    if dims.ep > 1:  # the ep group lies within one pp rank: the same stages' blocks
        group = collectives.all_reduce(group, dims.get_mesh("ep"), "ep", "sum")
    # with tp > 1 every tp rank routes all its tp group's tokens (sequence parallel, ep
    # borrowing tp), then sends its 1/tp share of them: each token is counted tp times
    copies = options.tp
    load = round(int(group[mine].sum()) / copies)
    expert_params = [
        p
        for part in parts
        for name, p in part.named_parameters()
        if ".feed_forward.experts." in f".{name}"
    ]
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in expert_params)
    full = sum(p.numel() for p in expert_params)  # this rank's stages' experts, all of them
    rows = _gather_ints([*local_total.tolist(), load, held, full], options)
    n = options.experts
    per_expert = [sum(row[e] for row in rows) // copies for e in range(n)]
    staged = f"; pp={options.pp}: each rank routes its stage's blocks" if options.pp > 1 else ""
    lines = [
        f"experts (qwen3-moe, {n} per block, top-{min(2, n)}; ep={options.ep}: "
        f"{experts_per_rank} per rank; tp={options.tp} dp_shard={options.dp_shard}{staged}):",
        f"  tokens per expert (all {options.steps} steps, all blocks, all ranks): {per_expert}",
    ]
    if options.pp > 1:
        by_stages: dict[str, list[int]] = {}
        for r, row in enumerate(rows):
            counts = by_stages.setdefault(_stage_label(options, r).strip(" ()"), [0] * n)
            for e in range(n):
                counts[e] += row[e]
        lines += [
            f"    {stages}: {[c // copies for c in counts]}" for stages, counts in by_stages.items()
        ]
    lines.append("  tokens per rank (routed to the experts it holds, from its ep group):")
    of = "of"
    if options.pp > 1:
        of = "of its stages'" if len(_stages_of(options, 0)) > 1 else "of its stage's"
    for r, row in enumerate(rows):
        mine_held, mine_full = row[n + 1], row[n + 2]
        lines.append(
            f"    rank {r}{_stage_label(options, r)}: {row[n]:6d} tokens   expert weights "
            f"{mine_held:7d} {of} {mine_full} ({mine_held / max(mine_full, 1):.3f}; "
            f"ep={dims.ep} efsdp={dims.efsdp})"
        )
    lines.append(
        "  collectives over 'ep' per training step (rank 0"
        + _pipeline_note(options)
        + "; dispatch, combine, backward):"
    )
    return lines + _axis_lines(on_ep)


def _cp_section(options: Options, block_bytes: list[int], on_cp: dict[str, list[int]]) -> list[str]:
    """One block's activation bytes per rank, against one process's; the cp collectives.

    With ``--pp`` each rank shows its stage's first block, run on one microbatch at a time.
    """
    cfg = options.model
    one_process = options.batch_size * options.seq_len * cfg.dim * 4  # float32 [b, s, dim]
    rows = _gather_ints(block_bytes, options)
    microbatches = options.microbatches if options.pp > 1 else 1
    split = options.dp_shard * options.cp * (options.tp if cfg.sequence_parallel else 1)
    factors = "dp_shard x cp" + (" x tp" if cfg.sequence_parallel else "")
    if microbatches > 1:
        split, factors = split * microbatches, factors + " x microbatches"
    per = "per rank" + (", its stage's first block, one microbatch" if options.pp > 1 else "")
    lines = [
        f"context parallelism (cp={options.cp}, {options.cp_attention} attention"
        + (", packed documents" if options.packed else "")
        + f"; tp={options.tp} dp_shard={options.dp_shard}"
        + (f" pp={options.pp}, {microbatches} microbatches" if options.pp > 1 else "")
        + "):",
        f"  one block's output activations {per} (one process: {one_process / 1024:.1f} KiB):",
    ]
    for r, (size, block) in enumerate(rows):
        where = f"{_stage_label(options, r)[:-1]}, block {block})" if options.pp > 1 else ""
        lines.append(
            f"    rank {r}{where}: {size / 1024:8.1f} KiB  ({size / one_process:.3f} of one "
            f"process; 1 / ({factors}) = {1 / split:.3f})"
        )
    lines.append(
        "  collectives over 'cp' per training step (rank 0"
        + _pipeline_note(options)
        + f"; {options.cp_attention}):"
    )
    return lines + _axis_lines(on_cp)
