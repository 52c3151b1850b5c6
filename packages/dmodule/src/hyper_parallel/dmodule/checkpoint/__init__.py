"""Checkpoints of parallelized models with ``torch.distributed.checkpoint``, and Hugging Face weights.

Example::

    from hyper_parallel.dmodule.checkpoint import ModelState, TrainingState, load, save

    state = {"app": ModelState(model, optimizer), "train": TrainingState()}
    save(state, "ckpt", step=10)          # ckpt/step-10, committed once every rank is done
    step = load(state, "ckpt")            # the latest step, resharded onto this model's mesh

A checkpoint is code: its ``.metadata`` and non-tensor values are pickles that ``load``
unpickles (each file is first checked against the checkpoint's manifest, which catches
damage, not a planted checkpoint). Load only checkpoints you trust.
"""

from hyper_parallel.dmodule.checkpoint.hf import load_hf, save_hf
from hyper_parallel.dmodule.checkpoint.manifest import MANIFEST, read_manifest
from hyper_parallel.dmodule.checkpoint.state_dict import (
    ModelState,
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from hyper_parallel.dmodule.checkpoint.store import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    PendingSave,
    UnverifiedCheckpointWarning,
    committed_steps,
    latest_step,
    load,
    save,
    step_path,
    verify_checkpoint,
)
from hyper_parallel.dmodule.checkpoint.training_state import TrainingState

__all__ = [
    "MANIFEST",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "ModelState",
    "PendingSave",
    "StateDictOptions",
    "TrainingState",
    "UnverifiedCheckpointWarning",
    "committed_steps",
    "get_state_dict",
    "latest_step",
    "load",
    "load_hf",
    "read_manifest",
    "save",
    "save_hf",
    "set_state_dict",
    "step_path",
    "verify_checkpoint",
]
