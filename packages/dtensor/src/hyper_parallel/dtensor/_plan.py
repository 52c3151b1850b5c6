"""``Plan`` and ``OpInfo``: one call's precomputed work, and what planning knows of an op."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from hyper_parallel.dtensor._registry import (
    Decision,
    LocalFn,
    Rewrite,
    Rule,
    RuleRegistry,
    Special,
)
from hyper_parallel.dtensor._spec import DTensorSpec
from hyper_parallel.dtensor.placement_types import Placement

Placements = tuple[Placement, ...]


class Result(enum.Enum):
    """How an op's result is built from the local call's result."""

    WRAP = "wrap"  # wrap every tensor output with its planned spec
    ALIASES = "aliases"  # return the written DTensor arguments the schema's returns alias
    NOTHING = "nothing"  # the op returns nothing (e.g. in-place foreach ops)


@dataclass(slots=True)
class OpInfo:
    """What planning knows about one op overload, computed once from its schema and the registry."""

    func: torch._ops.OpOverload
    special: Special | None
    rule: Rule | None
    floats_by_type: bool  # float arguments key the cache by type only (the rule ignores values)
    written: tuple[str, ...]  # names of the arguments the op writes
    return_aliases: tuple[str | None, ...]  # per schema return: the written argument it is
    returns_list: bool  # the op returns a Tensor[] (its outputs as a list)
    plans: dict[Any, Plan] = field(default_factory=dict)
    # the dispatcher's fast path: its key (spec hashes for specs, else as ``plans``) ->
    # (plan, the specs it was derived for); a hit is used only when the specs are equal
    fast: dict[Any, tuple[Plan, tuple[DTensorSpec, ...]]] = field(default_factory=dict)
    # no return aliases an argument: a result is a fresh tensor (never a lazily
    # conjugated or negated view)
    fresh_returns: bool = False
    owner: Any = None  # the dispatcher that derived it


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything one call needs, precomputed from the rule's decision (or a fallback plan)."""

    fallback: bool
    fn: LocalFn
    mutated: tuple[int, ...]  # DTensor indices the op writes
    result: Result
    returned: tuple[tuple[int, ...], ...]  # per return: DTensor indices it aliases
    moves: tuple[tuple[int, Placements], ...] = ()  # (DTensor index, target) of moving inputs
    moved_specs: tuple[DTensorSpec | None, ...] = ()  # spec after the move, per DTensor
    relabel: tuple[tuple[int, DTensorSpec], ...] = ()  # written DTensors whose layout changes
    single: DTensorSpec | None = None  # the op returns one tensor, wrapped with this spec
    out_specs: tuple[DTensorSpec | None, ...] = ()
    out_local_shapes: list[tuple[int, ...] | None] = field(default_factory=list)
    rewrite: Rewrite | None = None
    reason: str = ""
    outside: bool = False  # this rank is not in the mesh: it holds empty locals, computes nothing
    returns_list: bool = False
    decision: Decision | None = None  # the rule's answer (None for a fallback plan)
    cost: float = 0.0  # bytes a rank sends: input moves and in-kernel reductions (estimate)
    # the local call is the op itself on fresh results (no rule's local function): its
    # result carries no lazy conjugate or negative bit for the wrapper to copy
    fresh: bool = False
    # nothing moves or is rewritten, one result wrapped as ``single``: the dispatcher's
    # fast path runs ``fn`` on the local arguments itself (what ``run_plan`` would do)
    direct: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        direct = (
            not self.fallback
            and not self.outside
            and not self.moves
            and self.rewrite is None
            and self.single is not None
        )
        object.__setattr__(self, "direct", direct)


def derive_op_info(func: torch._ops.OpOverload, registry: RuleRegistry) -> OpInfo:
    """The planning state of ``func``: its schema's aliasing, its rule or special.

    Example::

        derive_op_info(torch.ops.aten.mm.default, registry).rule   # the matrix-product rule
    """
    schema = func._schema
    written = tuple(
        a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write
    )
    aliases: list[str | None] = []
    for r in schema.returns:
        name = None
        if r.alias_info is not None and r.alias_info.is_write:
            for a in schema.arguments:
                ai = a.alias_info
                if ai is not None and ai.is_write and ai.before_set == r.alias_info.before_set:
                    name = a.name
                    break
        aliases.append(name)
    rule = registry.rule_for(func)
    special = registry.special_for(func)
    if special is None and rule is None and _composite(func):
        special = _decompose
    returns = schema.returns
    return OpInfo(
        func=func,
        special=special,
        rule=rule,
        floats_by_type=torch.Tag.pointwise in func.tags
        or schema.name.startswith("aten::_foreach_"),
        written=written,
        return_aliases=tuple(aliases),
        returns_list=len(returns) == 1 and str(returns[0].type).startswith("List"),
        fresh_returns=all(r.alias_info is None for r in returns),
    )


def _composite(func: torch._ops.OpOverload) -> bool:
    """True for ops torch defines by a decomposition (linear, matmul, reshape, ...)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(),  # type: ignore[no-untyped-call]
        torch._C.DispatchKey.CompositeImplicitAutograd,
    )


def _decompose(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run a composite op as its decomposition, whose ops have rules.

    Such ops reach DTensors whole only where autograd is off (``inference_mode``);
    decomposing them there, as autograd does elsewhere, keeps e.g. a sharded weight
    of ``linear`` in place instead of gathering it in the fallback.
    """
    return func.decompose(*args, **kwargs)


@dataclass(frozen=True, slots=True)
class _Mutation:
    """What an op writes and returns, as DTensor indices of one call."""

    mutated: tuple[int, ...] = ()
    result: Result = Result.WRAP
    returned: tuple[tuple[int, ...], ...] = ()
