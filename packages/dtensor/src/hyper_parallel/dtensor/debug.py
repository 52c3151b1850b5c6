"""``CommDebugMode``: count the collectives DTensor ops issue, by kind, bytes and module.

Collectives report through :func:`~hyper_parallel.dtensor.collectives.observe_collectives`;
the mode observes from enter to exit. Module attribution
uses global forward pre/post hooks, so a collective issued while a module's
``forward`` runs is charged to that module's fully qualified name (the innermost
module; ``""`` for the root, ``"global"`` outside any forward). Collectives issued
during ``backward()`` run outside every forward and are charged to ``"backward"``
when autograd is executing a backward pass. Fqns are learnt from the modules given
to the constructor (``named_modules()``); other modules show as their class name.

Collectives that run as torch's functional collectives (``torch.ops._c10d_functional``)
without passing through hp-dtensor's collectives module — the collectives of code compiled
with ``torch.compile``, which its graphs issue themselves — are recorded too, by a
``TorchDispatchMode`` active with the mode (:class:`_FunctionalCollectives`). Their mesh
axis is the live mesh axis whose group they run on (else the group's name); inside a
compiled graph the module hooks do not run, so they are charged to the module whose
forward called the compiled code (or ``"global"`` / ``"backward"``).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any

import torch
from torch._C._distributed_c10d import _resolve_process_group
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import GroupName
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from hyper_parallel.dtensor import collectives
from hyper_parallel.dtensor._dispatch import _flat
from hyper_parallel.dtensor._tensor import DTensor, fallback_counts
from hyper_parallel.dtensor.collectives import CollectiveRecord, Observer
from hyper_parallel.dtensor.device_mesh import _axis_of_group

__all__ = ["CommDebugMode", "explain"]

KINDS = (
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "scatter",
    "send_recv",
)


# The modes active in this context, innermost last: what the module hooks report to.
_active_modes: ContextVar[tuple[CommDebugMode, ...]] = ContextVar("hp_comm_debug_modes", default=())


# The module hooks report to the active modes. While dynamo traces they do nothing, and
# once dynamo is loaded they are registered marked to be traced rather than be graph
# breaks (hp-dtensor's files are on dynamo's skip list); they would not run with the
# compiled graph anyway. Dynamo guards on the global hooks' ids, so a compiled region
# traced under one mode recompiles once under the next (each mode registers them anew).
def _enter_module(module: torch.nn.Module, args: Any) -> None:
    if not torch.compiler.is_compiling():
        for mode in _active_modes.get():
            mode._enter_module(module)


def _exit_module(module: torch.nn.Module, args: Any, output: Any) -> None:
    if not torch.compiler.is_compiling():
        for mode in _active_modes.get():
            mode._exit_module()


_traced_hooks: list[Callable[..., None]] = []


def _module_hooks() -> tuple[Callable[..., None], Callable[..., None]]:
    """The hooks to register: marked for dynamo once it is loaded (never imported here:
    importing it costs seconds; a program that compiles has loaded it)."""
    if "torch._dynamo" not in sys.modules:
        return _enter_module, _exit_module
    if not _traced_hooks:
        import torch._dynamo

        _traced_hooks.extend(
            torch._dynamo.dont_skip_tracing(hook) for hook in (_enter_module, _exit_module)
        )
    return _traced_hooks[0], _traced_hooks[1]


class CommDebugMode:
    """Count collectives (by kind, bytes and module) and list ops that fell back, while active.

    Bytes are this rank's input bytes of each collective.

    Example::

        with CommDebugMode(model) as comm:
            model(x).sum().backward()
        comm.counts()        # {"all_gather": 2, "all_reduce": 1}
        print(comm.table())
    """

    def __init__(self, *modules: torch.nn.Module) -> None:
        self._names: dict[int, str] = {}
        for root in modules:
            for name, module in root.named_modules():
                self._names.setdefault(id(module), name)
        self._counts: Counter[str] = Counter()
        self._bytes: Counter[str] = Counter()
        self._by_module: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self._bytes_by_module: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self._records: list[CollectiveRecord] = []
        self._stack: list[str] = []
        self._handles: list[RemovableHandle] = []
        self._observing: contextlib.ExitStack | None = None
        self._fallbacks_before: dict[str, int] = {}
        self._fallbacks: dict[str, int] = {}
        self._active = False
        self._token: Token[tuple[CommDebugMode, ...]] | None = None

    # -- context manager -------------------------------------------------------------
    def __enter__(self) -> CommDebugMode:
        if self._active:
            raise RuntimeError("CommDebugMode: already active; a mode cannot be entered twice")
        self._observing = contextlib.ExitStack()
        self._observing.enter_context(collectives.observe_collectives(self._record))
        self._observing.enter_context(_FunctionalCollectives(self._record))
        if not _active_modes.get():  # the outermost mode hooks; the hooks report to every mode
            hooks = torch.nn.modules.module
            enter, exit_ = _module_hooks()
            self._handles = [
                hooks.register_module_forward_pre_hook(enter),
                hooks.register_module_forward_hook(exit_),
            ]
        self._token = _active_modes.set((*_active_modes.get(), self))
        self._fallbacks_before = fallback_counts()
        self._active = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._token is not None:
            _active_modes.reset(self._token)
            self._token = None
        if self._observing is not None:
            self._observing.close()
            self._observing = None
        after = fallback_counts()
        for op, n in after.items():
            grew = n - self._fallbacks_before.get(op, 0)
            if grew > 0:
                self._fallbacks[op] = self._fallbacks.get(op, 0) + grew
        self._stack.clear()
        self._active = False

    # -- recording -------------------------------------------------------------------
    def _module_name(self, module: torch.nn.Module) -> str:
        return self._names.get(id(module), type(module).__name__)

    def _enter_module(self, module: torch.nn.Module) -> None:
        self._stack.append(self._module_name(module))

    def _exit_module(self) -> None:
        if self._stack:
            self._stack.pop()

    def _record(self, record: CollectiveRecord) -> None:
        kind, nbytes = record.kind, record.nbytes
        self._records.append(record)
        if self._stack:
            where = self._stack[-1]
        elif torch._C._current_graph_task_id() != -1:
            where = "backward"
        else:
            where = "global"
        self._counts[kind] += 1
        self._bytes[kind] += nbytes
        self._by_module[where][kind] += 1
        self._bytes_by_module[where][kind] += nbytes

    # -- reports ---------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """Number of collectives of each kind.

        Example::

            comm.counts()   # {"all_gather": 1}
        """
        return dict(self._counts)

    def bytes(self) -> dict[str, int]:
        """Bytes (this rank's inputs) of each kind of collective.

        Example::

            comm.bytes()    # {"all_gather": 64}
        """
        return dict(self._bytes)

    def records(self) -> list[CollectiveRecord]:
        """Every collective in issue order: kind, this rank's input bytes, group size, mesh axis.

        Example::

            [(r.kind, r.mesh_axis, r.group_size) for r in comm.records()]  # [("all_reduce", "tp", 2)]
        """
        return list(self._records)

    def by_module(self) -> dict[str, dict[str, int]]:
        """Collective counts per module fqn (``"global"``, ``"backward"`` outside any forward).

        Example::

            comm.by_module()   # {"layers.0": {"all_reduce": 1}}
        """
        return {name: dict(c) for name, c in self._by_module.items()}

    def fallbacks(self) -> dict[str, int]:
        """Ops that ran through the gather-to-Replicate fallback while active, with counts.

        Example::

            comm.fallbacks()   # {"aten.cumsum.default": 1}
        """
        return dict(self._fallbacks)

    def to_dict(self) -> dict[str, Any]:
        """Everything recorded, as a JSON-serialisable dict.

        Example::

            json.dumps(comm.to_dict())
        """
        return {
            "counts": self.counts(),
            "bytes": self.bytes(),
            "by_module": {
                name: {
                    kind: {"count": n, "bytes": self._bytes_by_module[name][kind]}
                    for kind, n in c.items()
                }
                for name, c in self._by_module.items()
            },
            "fallbacks": self.fallbacks(),
        }

    def table(self) -> str:
        """A printable table: one row per (module, kind), then the fallbacks.

        Example::

            print(comm.table())
        """
        rows: list[tuple[str, str, str, str]] = [("module", "collective", "count", "bytes")]
        for name in sorted(self._by_module):
            for kind in _ordered(self._by_module[name]):
                rows.append(
                    (
                        name or "<root>",
                        kind,
                        str(self._by_module[name][kind]),
                        str(self._bytes_by_module[name][kind]),
                    )
                )
        for kind in _ordered(self._counts):
            rows.append(("total", kind, str(self._counts[kind]), str(self._bytes[kind])))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
        if self._fallbacks:
            lines.append(
                "fell back: " + ", ".join(f"{op} x{n}" for op, n in self._fallbacks.items())
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CommDebugMode(counts={json.dumps(self.counts())}, fallbacks={self.fallbacks()})"


_functional = torch.ops._c10d_functional
# torch's functional collectives (what funcol and inductor's graphs call) -> hp's kind;
# their first argument is this rank's input (a list of inputs for the coalesced ones)
_FUNCTIONAL_KINDS: dict[Any, str] = {
    _functional.all_reduce: "all_reduce",
    _functional.all_reduce_: "all_reduce",
    _functional.all_reduce_coalesced: "all_reduce",
    _functional.all_reduce_coalesced_: "all_reduce",
    _functional.all_gather_into_tensor: "all_gather",
    _functional.all_gather_into_tensor_out: "all_gather",
    _functional.all_gather_into_tensor_coalesced: "all_gather",
    _functional.reduce_scatter_tensor: "reduce_scatter",
    _functional.reduce_scatter_tensor_out: "reduce_scatter",
    _functional.reduce_scatter_tensor_coalesced: "reduce_scatter",
    _functional.all_to_all_single: "all_to_all",
    _functional.broadcast: "broadcast",
    _functional.broadcast_: "broadcast",
    _functional.isend: "send_recv",
}


class _FunctionalCollectives(TorchDispatchMode):  # type: ignore[misc,no-untyped-call]
    """Report torch's functional collectives that hp-dtensor's collectives module did not issue.

    Those it issues are reported already (``collectives.issued_here()``); every op runs
    unchanged. ``ignore_compile_internals``: dynamo still compiles under the mode (it is
    off while dynamo and inductor trace) and the compiled graphs' ops reach it at run time.
    """

    def __init__(self, observer: Observer) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._observer = observer
        self._axes: dict[str, tuple[int, str | int]] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kind = _FUNCTIONAL_KINDS.get(func.overloadpacket)
        if kind is not None and not collectives.issued_here():
            self._report(kind, args, kwargs or {})
        return func(*args, **(kwargs or {}))

    def _report(self, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        inputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
        nbytes = sum(t.numel() * t.element_size() for t in inputs)
        # the group is the last argument of every functional collective
        group = kwargs.get("group_name", args[-1])
        size, axis = self._group(group)
        self._observer(CollectiveRecord(kind, nbytes, size, axis))

    def _group(self, group: str | ProcessGroup) -> tuple[int, str | int]:
        """The group's size and its mesh axis (the group's name when no live mesh has it)."""
        name = group if isinstance(group, str) else group.group_name
        found = self._axes.get(name)
        if found is None:
            process_group = (
                _resolve_process_group(GroupName(name)) if isinstance(group, str) else group
            )
            axis = _axis_of_group(process_group)
            found = self._axes[name] = (process_group.size(), name if axis is None else axis)
        return found


def _ordered(kinds: Iterable[str]) -> list[str]:
    known = [k for k in KINDS if k in kinds]
    return known + sorted(k for k in kinds if k not in KINDS)


def explain(func: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> str:
    """How hp-dtensor would run an aten op on these DTensors, without running it.

    Names the rule's layout (which inputs move, from and to which placements), the
    output placements, the in-kernel reductions the rule declares (``Decision.reduces``)
    and the estimated bytes a rank sends; or why the op takes the fallback.

    Example::

        print(explain(torch.ops.aten.mm.default, x, w))
        # aten.mm.default: sharding rule
        #   input 1: (Shard(dim=0),) -> (Replicate(),)
        #   ...
    """
    plan = DTensor._op_dispatcher.plan_for(func, args, kwargs)
    if plan is None:
        return f"{func}: a whole-call handler (special) takes it; it plans inside"
    if plan.fallback:
        return f"{func}: fallback (gather to Replicate, run on full tensors) because {plan.reason}"
    dtensors = [a for a in _flat(args, kwargs) if isinstance(a, DTensor)]
    lines = [f"{func}: sharding rule"]
    for i, target in plan.moves:
        lines.append(f"  input {i}: {dtensors[i]._spec.placements} -> {target}")
    for j, spec in enumerate(plan.out_specs):
        if spec is not None:
            lines.append(f"  output {j}: {spec.placements}")
    decision = plan.decision
    if decision is not None and decision.reduces:
        lines.append(f"  in-kernel all-reduce over mesh axes {decision.reduces}")
    lines.append(f"  estimated bytes sent per rank: {plan.cost:.0f}")
    return "\n".join(lines)
