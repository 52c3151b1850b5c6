"""The sharding-rule registry: what a rule sees (``OpCall``), what it answers (``Decision``), where it goes.

Rule modules (``_ops/*``) import this module and nothing of planning or dispatch: a
rule maps a call's layouts to a decision and never communicates itself (a decision's
``local_fn`` may, through :mod:`hyper_parallel.dtensor.collectives`). A *special*
takes a whole call instead (ops that are not shard-local: ``detach``, ``copy_`` from a
full tensor, random fills).

The tables live in one :class:`RuleRegistry`, :data:`registry`, which DTensor's
dispatcher holds; every registration tells the dispatcher to forget what it derived
from them, so a rule registered late is seen by the next call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hyper_parallel.dtensor._spec import DTensorSpec, TensorMeta
from hyper_parallel.dtensor.device_mesh import DeviceMesh
from hyper_parallel.dtensor.placement_types import Placement

__all__ = [
    "Decision",
    "Declined",
    "LocalFn",
    "OpCall",
    "Rewrite",
    "Rule",
    "RuleRegistry",
    "Special",
    "register_rule",
    "register_special",
    "register_tag_rule",
    "registry",
    "rule_for",
    "special_for",
]

aten = torch.ops.aten

Placements = tuple[Placement, ...]


@dataclass(slots=True)
class OpCall:
    """What a sharding rule sees of one op call.

    ``args``/``kwargs`` hold the call's arguments with each DTensor replaced by its
    :class:`DTensorSpec`; ``specs`` lists those specs in argument order;
    ``out_metas`` the global metadata of each tensor output (``None`` for
    non-tensor outputs), in output order.
    """

    func: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    specs: list[DTensorSpec]
    mesh: DeviceMesh
    out_metas: list[TensorMeta | None]


LocalFn = Callable[..., Any]
"""Called like the op, on local tensors, in place of the op."""


Rewrite = Callable[
    [Sequence[Any], dict[str, Any], list[tuple[int, ...] | None]],
    tuple[Sequence[Any], dict[str, Any]],
]
"""``rewrite(local_args, local_kwargs, out_local_shapes) -> (local_args, local_kwargs)``."""


@dataclass(slots=True)
class Decision:
    """A rule's answer: input placements (per spec), output placements (per output).

    ``local_fn`` replaces the op for the local computation (called like the op,
    on local tensors); ``rewrite(args, kwargs, out_local_shapes)`` rewrites the
    non-tensor arguments of the local call (e.g. a view's target shape).
    ``reduces`` declares the mesh axes over which ``local_fn`` all-reduces (a sharded
    norm, softmax or loss): the cost model (``_ops._strategy.decision_cost``) and
    ``debug.explain`` count that communication, which the input moves do not show.
    """

    inputs: list[Placements]
    outputs: list[Placements | None]
    local_fn: LocalFn | None = None
    rewrite: Rewrite | None = None
    reduces: tuple[int, ...] = ()


Rule = Callable[[OpCall], "Decision | None"]
"""A sharding rule: ``None`` (or raising :class:`Declined`) declines the call, which then
takes the fallback; any other exception is a bug in the rule and propagates."""


class Declined(Exception):
    """Raised by a rule (or a helper it calls, such as ``choose``) to decline a call."""


Special = Callable[[torch._ops.OpOverload, tuple[Any, ...], dict[str, Any]], Any]
"""A handler of a whole call: ``special(func, args, kwargs)`` with the DTensors in ``args``."""


class RuleRegistry:
    """The sharding rules and whole-call handlers of ops, with the watchers of changes.

    One instance, :data:`registry`, holds every rule of the package (rule modules fill it
    at import through :func:`register_rule` and kin); DTensor's dispatcher holds it and
    watches it, so a rule registered late is seen by the next call.
    """

    def __init__(self) -> None:
        self._rules: dict[Any, Rule] = {}
        self._tag_rules: dict[Any, Rule] = {}
        self._specials: dict[Any, Special] = {}
        self._watchers: list[Callable[[], None]] = []

    def watch(self, on_change: Callable[[], None]) -> None:
        """Call ``on_change()`` after every registration (a dispatcher forgets what it derived).

        Example::

            registry.watch(lambda: print("a rule changed"))
        """
        self._watchers.append(on_change)

    def _changed(self) -> None:
        for on_change in self._watchers:
            on_change()

    def register_rule(self, *ops: Any) -> Callable[[Rule], Rule]:
        """Register a sharding rule for op overloads (or whole overload packets).

        Example::

            @register_rule(torch.ops.aten.relu.default)
            def relu_rule(call: OpCall) -> Decision: ...
        """

        def deco(rule: Rule) -> Rule:
            for op in ops:
                self._rules[op] = rule
            self._changed()
            return rule

        return deco

    def register_special(self, *ops: Any) -> Callable[[Special], Special]:
        """Register a handler that takes the whole call (for ops that are not shard-local).

        Example::

            @register_special(torch.ops.aten.detach.default)
            def detach(func, args, kwargs): ...
        """

        def deco(handler: Special) -> Special:
            for op in ops:
                self._specials[op] = handler
            self._changed()
            return handler

        return deco

    def register_tag_rule(self, tag: Any, rule: Rule) -> None:
        """Register the rule of every op carrying ``tag`` (e.g. ``torch.Tag.pointwise``).

        Example::

            register_tag_rule(torch.Tag.pointwise, pointwise_rule)
        """
        self._tag_rules[tag] = rule
        self._changed()

    def special_for(self, func: torch._ops.OpOverload) -> Special | None:
        """The whole-call handler of an op overload, if one is registered.

        Example::

            special_for(torch.ops.aten.detach.default)   # the detach handler
        """
        return self._specials.get(func)

    def rule_for(self, func: torch._ops.OpOverload) -> Rule | None:
        """The rule of an op overload, of its overload packet, or of one of its tags.

        An in-place op (``mul_``) without a rule of its own takes the tag rule of its
        functional form (``mul``), which torch tags more consistently.

        Example::

            rule_for(torch.ops.aten.mm.default)   # the matrix-product rule
        """
        rule = self._rules.get(func) or self._rules.get(func.overloadpacket)
        if rule is None:
            rule = self._tag_rule(func)
        if rule is None and func._schema.name.endswith("_"):
            functional = getattr(aten, func._schema.name.split("::")[-1][:-1], None)
            overload = (
                getattr(functional, func._overloadname, None) if functional is not None else None
            )
            if isinstance(overload, torch._ops.OpOverload):
                rule = self._tag_rule(overload)
        return rule

    def _tag_rule(self, func: torch._ops.OpOverload) -> Rule | None:
        for tag in func.tags:
            rule = self._tag_rules.get(tag)
            if rule is not None:
                return rule
        return None


registry = RuleRegistry()
"""The package's rules: what ``_ops`` registers and DTensor's dispatcher consults."""

register_rule = registry.register_rule
register_special = registry.register_special
register_tag_rule = registry.register_tag_rule
rule_for = registry.rule_for
special_for = registry.special_for
