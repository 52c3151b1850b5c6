"""hp-dmodule's files import each other one way: no circle, no lazy module attributes.

Read with ``ast`` (nothing is imported): each file's module-level imports of hp-dmodule
files form a graph, and that graph has no cycle. Every import counted (inside functions
and ``TYPE_CHECKING`` blocks too, which a circle at import time hides in), the graph has no
cycle either, outside :data:`_ANNOTATION_ONLY_CIRCLES`. A circle is what forced the stubs and
module ``__getattr__``s ``containers.py`` once needed, so a module-level ``__getattr__``
is refused too. Implicit imports of parent packages (Python runs ``pkg/__init__`` before
``pkg.sub``) are not edges: they always run first and are no circle of the code's making.
A fresh interpreter then imports each container path first, as a user's script would.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest
from tests._package_files import module_file

_ROOT = Path(__file__).resolve().parents[2]
_PACKAGE = _ROOT / "packages" / "dmodule" / "src" / "hyper_parallel" / "dmodule"
_NAME = "hyper_parallel.dmodule"


def _files() -> list[str]:
    return sorted(p.relative_to(_PACKAGE).as_posix() for p in _PACKAGE.rglob("*.py"))


def _module_file(module: str) -> str | None:
    """The package file of a dotted module name (``None``: not a file of hp-dmodule)."""
    return module_file(_PACKAGE, _NAME, module)


def _top_level_nodes(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements run at import: ``if``/``try`` bodies included, ``TYPE_CHECKING`` ones not."""
    found: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                found += _top_level_nodes(node.body)
            found += _top_level_nodes(node.orelse)
        elif isinstance(node, ast.Try):
            found += _top_level_nodes(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                found += _top_level_nodes(handler.body)
        else:
            found.append(node)
    return found


def _edges(path: str, *, everywhere: bool = False) -> list[tuple[int, str]]:
    """``(line, file)`` for each hp-dmodule file that ``path`` imports at module level
    (``everywhere``: also inside functions, classes and ``TYPE_CHECKING`` blocks)."""
    tree = ast.parse((_PACKAGE / path).read_text())
    found: list[tuple[int, str]] = []
    nodes: list[ast.stmt] = (
        [n for n in ast.walk(tree) if isinstance(n, ast.stmt)]
        if everywhere
        else _top_level_nodes(tree.body)
    )
    for node in nodes:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                names.append(sub if _module_file(sub) is not None else node.module)
        for name in names:
            target = _module_file(name)
            if target is not None and target != path and (node.lineno, target) not in found:
                found.append((node.lineno, target))
    return found


def _cycles(graph: dict[str, list[tuple[int, str]]]) -> list[str]:
    """Each import circle, as ``a.py:3 -> b.py:7 -> a.py`` (one report per circle found)."""
    found: list[str] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[tuple[str, int]] = []

    def visit(node: str) -> None:
        state[node] = 1
        for line, target in graph.get(node, []):
            path.append((node, line))
            if state.get(target) == 1:
                start = next(i for i, (n, _) in enumerate(path) if n == target)
                found.append(" -> ".join(f"{n}:{ln}" for n, ln in path[start:]) + f" -> {target}")
            elif target not in state:
                visit(target)
            path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


@functools.cache  # read once per session: every file parsed; callers do not mutate it
def _graph(*, everywhere: bool = False) -> dict[str, list[tuple[int, str]]]:
    return {path: _edges(path, everywhere=everywhere) for path in _files()}


#: Files allowed to import each other in a circle, one set per circle: an import between two
#: files of one set is left out of the graph. The one kind left: a model's plan names the model
#: class in annotations only (under ``TYPE_CHECKING``), while the model builds its blocks'
#: layouts from the plan; at run time the imports go one way (model -> plan, model -> HF adapter).
_ANNOTATION_ONLY_CIRCLES: tuple[frozenset[str], ...] = (
    frozenset({"models/llama.py", "models/llama_sharding.py"}),
    frozenset({"models/qwen3.py", "models/qwen3_sharding.py"}),
)


def _without_allowed(
    graph: dict[str, list[tuple[int, str]]], allowed: tuple[frozenset[str], ...]
) -> dict[str, list[tuple[int, str]]]:
    """``graph`` less the imports between two files of one ``allowed`` set."""
    return {
        path: [
            (line, target)
            for line, target in edges
            if not any(path in group and target in group for group in allowed)
        ]
        for path, edges in graph.items()
    }


def _module_getattrs() -> list[str]:
    return [
        f"{path}:{node.lineno}"
        for path in _files()
        for node in ast.parse((_PACKAGE / path).read_text()).body
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
    ]


def test_the_graph_sees_the_containers_edge() -> None:
    """The parser resolves imports to files: containers.py imports module.py, not the reverse."""
    graph = _graph()
    assert "module.py" in {target for _, target in graph["containers.py"]}
    assert "containers.py" not in {target for _, target in graph["module.py"]}
    assert "module.py" in {target for _, target in graph["__init__.py"]}


def test_hp_dmodule_has_no_import_circle() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "hp-dmodule files that import each other in a circle:\n" + "\n".join(cycles)


def test_hp_dmodule_has_no_import_circle_counting_every_import() -> None:
    """Lazy and annotation-only imports count: a circle there is one a refactor trips over."""
    graph = _without_allowed(_graph(everywhere=True), _ANNOTATION_ONLY_CIRCLES)
    cycles = _cycles(graph)
    assert not cycles, "hp-dmodule files that import each other in a circle:\n" + "\n".join(cycles)


def test_every_import_is_seen_and_only_the_named_circles_are_left_out() -> None:
    """Function-level and ``TYPE_CHECKING`` imports are edges; the allowlist drops only its own."""
    everywhere = _graph(everywhere=True)
    # model_spec.py imports PipelineSplit under TYPE_CHECKING and inside a method, only there
    lines = [line for line, target in everywhere["model_spec.py"] if target == "pipeline/split.py"]
    assert len(lines) == 2, lines
    assert "pipeline/split.py" not in {target for _, target in _graph()["model_spec.py"]}
    graph = {"a.py": [(3, "b.py")], "b.py": [(7, "a.py")], "c.py": [(1, "a.py"), (2, "d.py")]}
    graph["d.py"] = [(5, "c.py")]
    left = _without_allowed(graph, (frozenset({"a.py", "b.py"}),))
    assert _cycles(left) == ["c.py:2 -> d.py:5 -> c.py"]


def test_hp_dmodule_has_no_module_getattr() -> None:
    found = _module_getattrs()
    assert not found, f"module-level __getattr__ (a lazy attribute hides an import): {found}"


def _annotation_edges(path: str) -> set[str]:
    """The hp-dmodule files ``path`` imports at module level, ``TYPE_CHECKING`` blocks included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse((_PACKAGE / path).read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if _module_file(sub) is not None else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {t for name in found if (t := _module_file(name)) is not None and t != path}


@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_each_reference_model_its_plan_and_its_hf_adapter_import_one_way(model: str) -> None:
    """The model imports its plan (its parts' layouts) and its HF adapter; the adapter imports
    no model file even for annotations, and the plan names the model for annotations only."""
    graph = _graph()
    model_file, plan, hf = (
        f"models/{model}.py",
        f"models/{model}_sharding.py",
        f"models/{model}_hf.py",
    )
    assert {plan, hf} <= {target for _, target in graph[model_file]}
    assert model_file not in _annotation_edges(hf), f"{hf} imports {model_file}"
    assert model_file not in {target for _, target in graph[plan]}, f"{plan} imports the model"


def test_a_circle_is_named_with_its_files_and_lines() -> None:
    graph = {"a.py": [(3, "b.py")], "b.py": [(7, "a.py")], "c.py": [(1, "a.py")]}
    assert _cycles(graph) == ["a.py:3 -> b.py:7 -> a.py"]
    assert _cycles({"a.py": [(1, "b.py")], "b.py": []}) == []


@pytest.mark.parametrize(
    "first",
    [
        "from hyper_parallel.dmodule.containers import ModuleList",
        "from hyper_parallel.dmodule.module import ModuleList",
        "from hyper_parallel.dmodule.models.llama import Llama",
        "from hyper_parallel.dmodule.models.llama_sharding import parallelize_llama",
    ],
)
def test_each_container_path_gives_the_same_class_in_a_fresh_interpreter(first: str) -> None:
    """Whatever a script imports first, every public path names one class per container."""
    script = f"""{first}
import pickle
import torch
import hyper_parallel.dmodule as root
from hyper_parallel.dmodule import containers, module
for name in ("ModuleList", "ModuleDict", "Sequential"):
    cls = getattr(root, name)
    assert cls is getattr(containers, name) is getattr(module, name), name
    assert cls is root.Module.from_nn_module(getattr(torch.nn, name)), name
    assert issubclass(cls, root.Module) and issubclass(cls, getattr(torch.nn, name)), name
    assert type(pickle.loads(pickle.dumps(cls()))) is cls, name
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
