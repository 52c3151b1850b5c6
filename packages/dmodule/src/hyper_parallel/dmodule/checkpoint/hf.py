"""Hugging Face checkpoints: load a transformers directory into a parallelized model, save one back.

``load_hf`` reads each rank's slice of each tensor straight from the safetensors
files (``safe_open(...).get_slice``), so no rank ever holds the full model.
``save_hf`` gathers one tensor at a time; rank 0 writes safetensors shards of
bounded size, an index and ``config.json`` that ``from_pretrained`` loads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hyper_parallel.dmodule.checkpoint.store import agree
from hyper_parallel.dmodule.model_spec import StateDictAdapter, spec_for_config
from hyper_parallel.dtensor import DTensor
from hyper_parallel.platform import get_platform

__all__ = ["load_hf", "save_hf"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def _safetensors() -> Any:
    try:
        import safetensors
        import safetensors.torch
    except ImportError as error:  # an optional dependency: hp-dmodule[hf]
        raise ImportError(
            "load_hf/save_hf need the safetensors package: pip install 'hp-dmodule[hf]'"
        ) from error
    return safetensors


def _adapter(model: torch.nn.Module, adapter: StateDictAdapter | None) -> StateDictAdapter:
    if adapter is not None:
        return adapter
    config = getattr(model, "config", None)
    spec = spec_for_config(config)
    if spec is None or spec.state_dict_adapter is None:
        raise ValueError(
            f"{type(model).__name__}: no adapter given and no registered ModelSpec with a "
            f"state_dict_adapter for its config ({type(config).__name__}); pass adapter="
        )
    built: StateDictAdapter = spec.state_dict_adapter(config)  # upstream: a class of the config
    return built


@dataclass(frozen=True)
class _Source:
    """Where one of our tensors lives in a Hugging Face checkpoint."""

    keys: tuple[str, ...]  # the Hugging Face keys
    stacked: bool  # True: keys[e] holds our tensor's [e] (per-expert weights stacked on dim 0)


def _hf_layout(model: torch.nn.Module, adapter: StateDictAdapter) -> dict[str, _Source]:
    """Our FQN -> its Hugging Face key(s), from the adapter.

    Stacked tensors come from the adapter's optional ``hf_stacks(fqns)``; every other key
    is found by passing the state dict's own tensors through ``to_hf``.
    """
    state = model.state_dict()
    hf_stacks = getattr(adapter, "hf_stacks", None)
    stacks: dict[str, list[str]] = hf_stacks(list(state)) if callable(hf_stacks) else {}
    layout = {fqn: _Source(tuple(keys), stacked=True) for fqn, keys in stacks.items()}
    rest = {k: v for k, v in state.items() if k not in stacks}
    by_id: dict[int, str] = {}
    for k, v in rest.items():  # a tied tensor (two FQNs, one tensor) is known by its first FQN
        by_id.setdefault(id(v), k)
    for hf_key, value in adapter.to_hf(rest).items():
        fqn = by_id.get(id(value))
        if fqn is None:
            raise ValueError(
                f"load_hf/save_hf: the adapter's to_hf changed the value of {hf_key!r}; only "
                "adapters that rename keys (values unchanged) can be read slice by slice; "
                "stacked tensors are declared by the adapter's hf_stacks(fqns)"
            )
        layout[fqn] = _Source((hf_key,), stacked=False)
    return layout


def _config_problems(root: Path, adapter: StateDictAdapter) -> list[str]:
    """The adapter's ``hf_config_problems(config.json)``: layout fields that disagree."""
    check = getattr(adapter, "hf_config_problems", None)
    path = root / "config.json"
    if not callable(check) or not path.is_file():
        return []
    problems: list[str] = check(json.loads(path.read_text()))
    return problems


def _weight_files(directory: Path) -> dict[str, Path]:
    """Hugging Face key -> the safetensors file holding it."""
    index = directory / _INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return {k: directory / f for k, f in weight_map.items()}
    single = directory / _SINGLE
    if not single.is_file():
        raise FileNotFoundError(f"load_hf: {directory} holds neither {_INDEX} nor {_SINGLE}")
    safetensors = _safetensors()
    with safetensors.safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _local_slices(value: torch.Tensor) -> tuple[slice, ...] | None:
    """The slice of the full tensor this rank holds (None: nothing, the rank is off the mesh)."""
    if not isinstance(value, DTensor):
        return tuple(slice(0, n) for n in value.shape)
    chunks = value.__create_chunk_list__()  # DCP's protocol: this rank's offsets and sizes
    if not chunks:
        return None
    (chunk,) = chunks
    return tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))


def load_hf(
    model: torch.nn.Module,
    directory: str | os.PathLike[str],
    adapter: StateDictAdapter | None = None,
) -> None:
    """Fill ``model`` (parallelized or not) from a transformers checkpoint directory.

    Each rank reads only the slices its shards hold; values are cast to the model's
    dtype. Every key and shape is checked before anything is copied; a tied
    ``lm_head`` (absent from the files) is read from the embedding. ``adapter``
    defaults to the model's ``ModelSpec.state_dict_adapter``; tensors its ``hf_stacks``
    declares (routed experts) are read expert by expert, each rank only its own, and a
    checkpoint its ``hf_config_problems`` finds another layout in is refused first.

    Example::

        model = Llama.Config.from_hf("hf-llama").build().parallelize(mesh)
        load_hf(model, "hf-llama")
    """
    root = Path(directory)
    adapter = _adapter(model, adapter)
    layout = _hf_layout(model, adapter)
    problems = _config_problems(root, adapter)
    if problems:
        raise ValueError(
            f"load_hf: {root} does not fit {type(model).__name__} (nothing was loaded): its "
            f"config.json differs in {'; '.join(problems)}"
        )
    files = _weight_files(root)
    config_path = root / "config.json"
    tied = config_path.is_file() and json.loads(config_path.read_text()).get(
        "tie_word_embeddings", False
    )
    if tied and "lm_head.weight" not in files and "model.embed_tokens.weight" in files:
        files["lm_head.weight"] = files["model.embed_tokens.weight"]
        tied_to = {"lm_head.weight": "model.embed_tokens.weight"}
    else:
        tied_to = {}
    state = model.state_dict()
    wanted = [key for source in layout.values() for key in source.keys]
    missing = sorted(hf for hf in wanted if hf not in files)
    unexpected = sorted(set(files) - set(wanted) - set(tied_to))
    safetensors = _safetensors()
    mis_shaped = []
    for fqn, source in layout.items():
        model_shape = tuple(state[fqn].shape)
        per_key = model_shape[1:] if source.stacked else model_shape
        for hf_key in source.keys:
            if hf_key in missing:
                continue
            with safetensors.safe_open(str(files[hf_key]), framework="pt") as f:
                shape = tuple(f.get_slice(tied_to.get(hf_key, hf_key)).get_shape())
            if shape != per_key:
                mis_shaped.append(f"{hf_key}: file {shape}, model {per_key}")
    if missing or unexpected or mis_shaped:
        raise ValueError(
            f"load_hf: {root} does not fit {type(model).__name__} (nothing was loaded); "
            f"missing: {missing}; unexpected: {unexpected}; mis-shaped: {mis_shaped}"
        )
    with torch.no_grad():
        for fqn, source in layout.items():
            value = state[fqn]
            index = _local_slices(value)
            if index is None:
                continue
            # to_local() views the shard's storage: copying into it fills the parameter
            target = value.to_local() if isinstance(value, DTensor) else value
            if not source.stacked:
                target.copy_(
                    _read(safetensors, files, tied_to.get(source.keys[0], source.keys[0]), index)
                )
                continue
            first = index[0].start  # this rank's experts: only their files are read
            for e in range(first, index[0].stop):
                target[e - first].copy_(_read(safetensors, files, source.keys[e], index[1:]))


def _read(
    safetensors: Any, files: dict[str, Path], hf_key: str, index: tuple[slice, ...]
) -> torch.Tensor:
    """The ``index`` slice of ``hf_key`` read from its file (nothing else of it is read)."""
    with safetensors.safe_open(str(files[hf_key]), framework="pt") as f:
        piece: torch.Tensor = f.get_slice(hf_key)[index]
    return piece


def _shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> Iterator[list[str]]:
    current: list[str] = []
    total = 0
    for key, nbytes in sizes:
        if current and total + nbytes > max_shard_bytes:
            yield current
            current, total = [], 0
        current.append(key)
        total += nbytes
    if current:
        yield current


def save_hf(
    model: torch.nn.Module,
    directory: str | os.PathLike[str],
    adapter: StateDictAdapter | None = None,
    *,
    config: dict[str, Any] | None = None,
    max_shard_bytes: int = 1 << 30,
) -> None:
    """Write ``model`` as a consolidated transformers directory (collective; rank 0 writes).

    One tensor is gathered at a time; rank 0 holds at most one safetensors shard of
    ``max_shard_bytes`` before writing it. ``config`` is the ``config.json``
    (default: the adapter's ``hf_config()``; llama-ref's gives ``llama_config_to_hf``).

    Example::

        save_hf(model, "hf-out")
        transformers.LlamaForCausalLM.from_pretrained("hf-out")
    """
    root = Path(directory)
    adapter = _adapter(model, adapter)
    layout = _hf_layout(model, adapter)
    state = model.state_dict()
    platform = get_platform()
    rank = platform.get_rank() if platform.is_initialized() else 0
    if config is None:
        config = _default_config(model, adapter)
    sizes = [(fqn, state[fqn].numel() * state[fqn].element_size()) for fqn in layout]
    plan = list(_shards(sizes, max_shard_bytes))
    safetensors = _safetensors()
    weight_map: dict[str, str] = {}
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
    for number, fqns in enumerate(plan, start=1):
        filename = (
            _SINGLE if len(plan) == 1 else f"model-{number:05d}-of-{len(plan):05d}.safetensors"
        )
        tensors: dict[str, torch.Tensor] = {}
        for fqn in fqns:
            value = state[fqn]
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if rank == 0:
                source = layout[fqn]
                full = full.detach().cpu()
                pieces = list(full.unbind(0)) if source.stacked else [full]
                for hf_key, piece in zip(source.keys, pieces, strict=True):
                    # a stacked row views the stack: safetensors wants each its own storage
                    tensors[hf_key] = piece.clone() if source.stacked else piece.contiguous()
                    weight_map[hf_key] = filename
            del full
        if rank == 0:
            safetensors.torch.save_file(tensors, str(root / filename), metadata={"format": "pt"})
        del tensors
    if rank == 0:
        if len(plan) > 1:
            total = sum(n for _, n in sizes)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (root / _INDEX).write_text(json.dumps(index, indent=2))
        (root / "config.json").write_text(json.dumps(config, indent=2))
    device_type = next(
        (p.device_mesh.device_type for p in state.values() if isinstance(p, DTensor)), "cpu"
    )
    agree(False, device_type)  # every rank sees the finished directory


def _default_config(model: torch.nn.Module, adapter: StateDictAdapter) -> dict[str, Any]:
    """The adapter's ``hf_config()`` (its model's ``config.json``), when it has one."""
    hf_config = getattr(adapter, "hf_config", None)
    if callable(hf_config):
        config: dict[str, Any] = hf_config()
        return config
    raise ValueError(
        f"save_hf: no config.json known for {type(model).__name__} (its adapter "
        f"{type(adapter).__name__} has no hf_config()); pass config= (a dict)"
    )
