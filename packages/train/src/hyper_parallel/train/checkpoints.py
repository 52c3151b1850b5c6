"""A job's checkpoint folder: checked before step 1, the step ``--resume`` continues, what it recorded.

Every check here reads JSON and directory listings only, except :func:`check_resumed_model`,
which reads DCP's ``.metadata`` (a pickle) after the checkpoint passed its manifest check.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from hyper_parallel.config import ConfigError
from hyper_parallel.dmodule.checkpoint import (
    CheckpointCorruptError,
    committed_steps,
    latest_step,
    read_manifest,
    step_path,
    verify_checkpoint,
)
from hyper_parallel.train.config import JobConfig

__all__ = [
    "check_checkpoint_dir",
    "check_resume",
    "check_resumed_model",
    "checkpoint_info",
    "clear_checkpoints",
    "corrupt_checkpoint_error",
]

#: the checkpointed model's states: ``ModelState`` under the trainer's ``"app"`` key
_MODEL_PREFIX = "app.model."


def check_checkpoint_dir(job: JobConfig, *, resume: bool) -> None:
    """``checkpoint.dir`` can hold this run's checkpoints: a directory (or creatable), and for a
    fresh run, no other run's checkpoints unless ``checkpoint.overwrite``.

    Example::

        >>> check_checkpoint_dir(JobConfig(), resume=False)  # no checkpoint.dir: nothing to check
    """
    directory = job.checkpoint.dir
    if not directory:
        return
    path = Path(directory)
    for place in (path, *path.parents):
        if place.exists():
            if not place.is_dir():
                raise ConfigError(
                    f"expected a directory for the checkpoints (or a path to create one), found "
                    f"{'that' if place == path else 'its parent'} {str(place)!r} is a file",
                    path="checkpoint.dir",
                )
            break
    if resume or job.checkpoint.overwrite:
        return
    newest = latest_step(path)
    if newest is not None:
        raise ConfigError(
            f"expected no checkpoints for a fresh run, found {directory!r} holding checkpoints "
            f"up to step {newest} (another run's?): continue that run with --resume, remove "
            "them with --checkpoint.overwrite=true, or choose another checkpoint.dir",
            path="checkpoint.dir",
        )


def clear_checkpoints(job: JobConfig) -> None:
    """Remove ``checkpoint.dir``'s committed and partial checkpoints (``checkpoint.overwrite``)."""
    root = Path(job.checkpoint.dir)
    if not root.is_dir():
        return
    for entry in root.iterdir():
        name = entry.name
        saved = name.startswith("step-") or (name.startswith(".step-") and "." in name[1:])
        if saved and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


def check_resume(job: JobConfig, *, verify: bool = False) -> int:
    """The step ``--resume`` continues from: ``checkpoint.resume_step``, else the newest committed.

    ``verify``: also check that checkpoint's files against its manifest (one process reads
    every file; the ranks' ``load`` checks it again).
    """
    if not job.checkpoint.dir:
        raise ConfigError(
            "--resume: expected a checkpoint directory, found none", path="checkpoint.dir"
        )
    steps = committed_steps(job.checkpoint.dir)
    if not steps:
        raise ConfigError(
            f"--resume: expected a committed checkpoint (step-N) in {job.checkpoint.dir!r}, found none",
            path="checkpoint.dir",
        )
    chosen = job.checkpoint.resume_step
    if chosen and chosen not in steps:
        raise ConfigError(
            f"--resume: expected a committed checkpoint of step {chosen} in "
            f"{job.checkpoint.dir!r}, found steps {steps}",
            path="checkpoint.resume_step",
        )
    found = chosen or steps[-1]
    if found >= job.training.steps:
        raise ConfigError(
            f"--resume: expected more steps than the checkpoint's {found}, found "
            f"{job.training.steps} (raise training.steps)",
            path="training.steps",
        )
    if verify:
        try:
            verify_checkpoint(job.checkpoint.dir, found)
        except CheckpointCorruptError as error:
            raise corrupt_checkpoint_error(error) from error
    return found


def corrupt_checkpoint_error(error: CheckpointCorruptError) -> ConfigError:
    """hp-train's words for a damaged checkpoint: the file, and how to resume from an intact one."""
    if error.intact is None:
        pick = "no older checkpoint there is intact (start afresh, --checkpoint.overwrite=true)"
    else:
        pick = (
            f"the newest intact one is step {error.intact}: resume from it with "
            f"--checkpoint.resume_step={error.intact}"
        )
    return ConfigError(
        f"--resume: checkpoint {str(error.path)!r} is damaged: {error.file} {error.problem}; "
        f"nothing was loaded; {pick}",
        path="checkpoint.dir",
    )


def checkpoint_info(job: JobConfig) -> dict[str, Any]:
    """What a checkpoint's manifest records of the run, for ``--resume`` to compare."""
    return {
        "model": job.model.name,
        "flavor": job.model.flavor,
        "seed": job.training.seed,
        "data_path": job.data.path,
    }


def check_resumed_model(job: JobConfig, model_config: Any, step: int) -> None:
    """``--resume`` onto checkpoint ``step``: the same model and shapes (ConfigError), the same seed
    and data (a warning: the run continues, but not as the saved run would have).

    Reads the manifest's record of the run, then (the checkpoint passed its manifest check)
    the tensor shapes in DCP's metadata against the job's model built on the meta device.
    """
    path = step_path(job.checkpoint.dir, step)
    info = (read_manifest(path) or {}).get("info", {})
    saved_model = info.get("model")
    if saved_model is not None and saved_model != job.model.name:
        raise ConfigError(
            f"--resume: expected a checkpoint of model {job.model.name!r}, found one of "
            f"{saved_model!r} in {str(path)!r}",
            path="checkpoint.dir",
        )
    for key, saved, now in [
        ("training.seed", info.get("seed"), job.training.seed),
        ("data.path", info.get("data_path"), job.data.path),
    ]:
        if saved is not None and saved != now:
            warnings.warn(
                f"--resume: checkpoint {str(path)!r} was saved by a run with {key} = {saved!r}, "
                f"this job has {now!r}: it continues on other data than that run would have",
                UserWarning,
                stacklevel=2,
            )
    with torch.device("meta"):
        model = model_config.build()
    known = set(model.state_dict())  # buffers too: a checkpoint may hold the persistent ones
    want = {k: tuple(v.shape) for k, v in model.named_parameters()}
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    have = {
        k[len(_MODEL_PREFIX) :]: tuple(v.size)
        for k, v in metadata.items()
        if k.startswith(_MODEL_PREFIX) and isinstance(v, TensorStorageMetadata)
    }
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - known)
    shapes = sorted(k for k in set(want) & set(have) if want[k] != have[k])
    if missing or extra or shapes:
        parts = [f"{k}: saved {list(have[k])}, this job's {list(want[k])}" for k in shapes[:3]]
        parts += [f"{k} not saved" for k in missing[:3]] + [
            f"{k} not in the model" for k in extra[:3]
        ]
        raise ConfigError(
            f"--resume: expected a checkpoint of this job's model shape, found {str(path)!r} "
            f"saved from another ({'; '.join(parts)}"
            f"{', ...' if len(missing) + len(extra) + len(shapes) > 3 else ''}): "
            "resume with the model.config it was saved with",
            path="model.config",
        )
