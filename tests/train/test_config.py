"""JobConfig: TOML in, dotted overrides, --print-config out (and back), errors naming the key."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hyper_parallel.config import ConfigError, Configurable
from hyper_parallel.dmodule import ParallelDims
from hyper_parallel.train import JobConfig, batch_layout, load_job, to_toml
from hyper_parallel.train.cli import main, preflight
from hyper_parallel.train.trainer import check_layout, resolve_world

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

#: The issue's example job: the names users' files rely on.
EXAMPLE = """
[model]
name = "llama-ref"
flavor = "debug"
[model.config]
dim = 64
[parallelism]
tp = 2
dp_shard = 1
[data]
path = "corpus/"
[training]
steps = 10
seq_len = 64
global_batch_size = 8
seed = 0
[optimizer]
lr = 3e-3
[lr_scheduler]
warmup_steps = 2
[checkpoint]
dir = "ckpt"
interval = 5
[metrics]
log_interval = 1
tensorboard_dir = "tb"
jsonl = "metrics.jsonl"
[validation]
interval = 5
steps = 2
"""


def test_the_example_job_reads_with_every_value_in_place(tmp_path: Path) -> None:
    file = tmp_path / "job.toml"
    file.write_text(EXAMPLE)
    job = load_job(file)
    assert job.model.config == {"dim": 64}
    assert (job.parallelism.tp, job.training.steps, job.training.seq_len) == (2, 10, 64)
    assert (job.checkpoint.dir, job.checkpoint.interval, job.metrics.jsonl) == (
        "ckpt",
        5,
        "metrics.jsonl",
    )
    assert (job.validation.interval, job.validation.steps, job.optimizer.lr) == (5, 2, 3e-3)


def test_toml_config_toml_round_trip(tmp_path: Path) -> None:
    file = tmp_path / "job.toml"
    file.write_text(EXAMPLE)
    job = load_job(file, ["lr_scheduler.decay_steps=7", "training.local_batch_size=2"])
    text = to_toml(job)
    again = JobConfig.from_dict(tomllib.loads(text))
    assert again == job
    assert to_toml(again) == text
    # every field written: the file alone says the whole job (only unset options are absent)
    assert tomllib.loads(text)["training"]["local_batch_size"] == 2


def test_print_config_writes_only_toml_that_reads_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "job.toml"
    file.write_text(EXAMPLE)
    assert main(["--config", str(file), "--print-config", "--training.steps=200"]) == 0
    out = capsys.readouterr().out
    assert JobConfig.from_dict(tomllib.loads(out)) == load_job(file, ["training.steps=200"])


def test_overrides_apply_over_the_file(tmp_path: Path) -> None:
    file = tmp_path / "job.toml"
    file.write_text(EXAMPLE)
    job = load_job(file, ["training.steps=200", "model.config.n_layers=3"])
    assert job.training.steps == 200
    assert job.model.config == {"dim": 64, "n_layers": 3}


@pytest.mark.parametrize(
    ("override", "key", "message"),
    [
        ("training.seq_len=abc", "training.seq_len", "expected int, found 'abc'"),
        ("training.seqlen=3", "training.seqlen", "did you mean 'seq_len'"),
        ("trainign.steps=3", "trainign", "did you mean 'training'"),
        ("training.steps=0", "training.steps", "expected an int >= 1, found 0"),
        ("lr_scheduler.decay=exp", "lr_scheduler.decay", "'cosine'"),
        ("optimizer.lr=-1", "optimizer.lr", "expected a finite float > 0"),
    ],
)
def test_bad_values_name_the_key(override: str, key: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        load_job(None, [override])
    assert error.value.path == key


def test_unknown_key_in_a_file_is_refused_with_the_file_and_key(tmp_path: Path) -> None:
    file = tmp_path / "job.toml"
    file.write_text("[training]\nstepz = 3\n")
    with pytest.raises(
        ConfigError, match=r"job.toml: training.stepz: unknown field 'stepz'.*'steps'"
    ):
        load_job(file)


def test_global_batch_must_divide_by_dp_times_local_batch() -> None:
    with pytest.raises(ConfigError, match=r"divide by dp .* = 2\) x local_batch_size \(3\)") as e:
        load_job(None, ["parallelism.dp_shard=2", "training.local_batch_size=3"])
    assert e.value.path == "training.global_batch_size"
    job = load_job(
        None,
        ["parallelism.dp_shard=2", "training.global_batch_size=8", "training.local_batch_size=2"],
    )
    assert batch_layout(job) == (2, 2)  # 8 = dp 2 x local 2 x accumulation 2


def test_dp_shard_minus_one_takes_the_rest_of_the_world(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rest = ["parallelism.dp_shard=-1", "parallelism.tp=2", "training.global_batch_size=8"]
    job = load_job(None, [*rest, f"data.path={tmp_path}"])
    # --print-config keeps -1: the file reads back to the same job
    assert main(["--print-config", *(f"--{o}" for o in rest), f"--data.path={tmp_path}"]) == 0
    assert JobConfig.from_dict(tomllib.loads(capsys.readouterr().out)) == job
    # the oracle: ParallelDims' own resolution on the same world
    resolved = resolve_world(job, 8)
    assert resolved.parallelism.dp_shard == ParallelDims(dp_shard=-1, tp=2, world_size=8).dp_shard
    assert batch_layout(resolved) == (2, 1)  # 8 = dp 4 x local 2
    with pytest.raises(ConfigError, match="rest of the world") as error:
        resolve_world(job, 5)
    assert error.value.path == "parallelism"
    # checks that need the world wait for it: a batch that does not divide by dp = 8 / 2
    with pytest.raises(ConfigError, match=r"divide by dp .* = 8\)") as error:
        check_layout(job.apply_overrides(["training.global_batch_size=12"]), 16)
    assert error.value.path == "training.global_batch_size"
    (tmp_path / "doc.txt").write_text("text " * 200)
    with pytest.raises(ConfigError, match=r"expected a world size \(--world-size N") as error:
        preflight(job, resume=False)
    assert error.value.path == "parallelism.dp_shard"
    assert preflight(job, resume=False, world_size=4) == 4
    with pytest.raises(ConfigError, match=r"expected an int >= 1 or -1 .*, found -2"):
        load_job(None, ["parallelism.dp_shard=-2"])


@pytest.mark.parametrize("ref", ["os:system", "builtins:eval"])
def test_a_job_cannot_name_arbitrary_code(
    ref: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    module = ref.split(":")[0]
    file = tmp_path / "job.toml"
    file.write_text(f'[model.config.param_init]\nweight = "{ref}"\n')
    # refused before any process starts, naming the key and the module: in a file ...
    assert main(["--config", str(file)]) == 2
    err = capsys.readouterr().err
    assert f"model.config.param_init.weight: refusing to import '{ref}': module '{module}'" in err
    # ... and on the command line
    assert main([f'--model.config.param_init={{"weight": "{ref}"}}']) == 2
    assert f"module '{module}' is not on the allowlist" in capsys.readouterr().err


def test_allow_import_admits_a_named_module(tmp_path: Path) -> None:
    from hyper_parallel.train.trainer import build_model_config

    job = load_job(None, ['model.config={"param_init": {"weight": "math:sqrt"}}'])
    with pytest.raises(ConfigError, match="'math' is not on the allowlist"):
        build_model_config(job, 257)
    import math

    assert build_model_config(job, 257, ("math",)).param_init == {"weight": math.sqrt}


def test_python_m_prints_the_config_without_starting_anything() -> None:
    import subprocess

    result = subprocess.run(
        [sys.executable, "-m", "hyper_parallel.train", "--print-config", "--training.steps=7"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert tomllib.loads(result.stdout)["training"]["steps"] == 7
    assert result.stderr == ""


def test_tensorboard_missing_stops_before_training_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hyper_parallel.train.metrics import check_metrics_extras

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # an import then fails
    job = load_job(None, ["metrics.tensorboard_dir=tb"])
    with pytest.raises(ConfigError, match=r"pip install 'hp-train\[tensorboard\]'") as error:
        check_metrics_extras(job)
    assert error.value.path == "metrics.tensorboard_dir"


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--world-size", "0"], "--world-size: expected an int >= 1 (the ranks to start), found 0"),
        (["--world-size=-3"], "--world-size: expected an int >= 1 (the ranks to start), found -3"),
        (["--dry-run", "--dry-run-memory=-1"], "--dry-run-memory: expected GiB > 0 per rank"),
    ],
)
def test_a_world_size_or_memory_budget_below_one_is_refused_naming_the_option(
    option: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_status:
        main(option)
    assert exit_status.value.code == 2
    assert message in capsys.readouterr().err


def test_a_checkpoint_folder_that_is_a_file_or_holds_another_run_is_refused_before_start(
    tmp_path: Path,
) -> None:
    from hyper_parallel.train.checkpoints import clear_checkpoints

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "doc.txt").write_text("text " * 200)
    job = load_job(None, [f"data.path={tmp_path / 'data'}", f"checkpoint.dir={tmp_path / 'ckpt'}"])
    (tmp_path / "ckpt").write_text("not a folder")
    with pytest.raises(ConfigError, match=r"found that '.*ckpt' is a file") as error:
        preflight(job, resume=False)
    assert error.value.path == "checkpoint.dir"
    (tmp_path / "ckpt").unlink()
    for saved in ("step-3", "step-7", ".step-9.partial"):  # committed: a .metadata
        (tmp_path / "ckpt" / saved).mkdir(parents=True)
        (tmp_path / "ckpt" / saved / ".metadata").write_bytes(b"")
    (tmp_path / "ckpt" / "notes.txt").write_text("kept")
    with pytest.raises(ConfigError, match=r"holding checkpoints up to step 7 .*--resume") as error:
        preflight(job, resume=False)
    assert error.value.path == "checkpoint.dir"
    overwrite = job.apply_overrides(["checkpoint.overwrite=true"])
    assert preflight(overwrite, resume=False) == 1
    clear_checkpoints(overwrite)  # what the run's rank 0 does before its first step
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["notes.txt"]


def test_an_empty_data_folder_is_refused_before_any_process_starts(tmp_path: Path) -> None:
    job = load_job(None, [f"data.path={tmp_path}"])
    with pytest.raises(FileNotFoundError, match=r"data.path = .*found no match"):
        preflight(job, resume=False)


def test_the_allowlist_walk_around_through_torch_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    walk = "torch.nn.functional:torch.os.system"
    marker = tmp_path / "ran"
    file = tmp_path / "job.toml"
    file.write_text(
        f'[model.config.param_init.weight]\n_partial_ = "{walk}"\nargs = ["touch {marker}"]\n'
    )
    with pytest.raises(SystemExit) as status:  # refused reading the file
        main(["--config", str(file)])
    assert status.value.code == 2
    err = capsys.readouterr().err
    assert f"refusing to import '{walk}': 'torch.os.system' passes through module 'torch'" in err
    assert main([f'--model.config.param_init={{"weight": "{walk}"}}']) == 2
    assert "passes through module 'torch'" in capsys.readouterr().err
    assert not marker.exists()


class _Activation(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        fn: Callable[..., object] | None = None

    def __init__(self, *, config: _Activation.Config) -> None:
        self.config = config


def test_the_allowlist_admits_torch_functional_compiled_kernels() -> None:
    """``torch.nn.functional:gelu`` is defined in torch._C._nn, a compiled part of torch itself."""
    import torch

    allowed = ("torch.nn.functional",)
    gelu = _Activation.Config.from_dict({"fn": "torch.nn.functional:gelu"}, allow_imports=allowed)
    assert gelu.fn is torch.nn.functional.gelu
    with pytest.raises(ConfigError, match="passes through module 'torch'"):
        _Activation.Config.from_dict(
            {"fn": "torch.nn.functional:torch.os.system"}, allow_imports=allowed
        )


def test_parallelism_compile_compiles_the_models_regions_or_is_refused_by_name() -> None:
    """``[parallelism] compile`` reaches the model (it was read nowhere: a silent no-op)."""
    from hyper_parallel.train.build import build_model_config

    def built(*overrides: str) -> Any:
        return build_model_config(load_job(None, list(overrides)), 256)

    assert not built("model.config.use_local_map=true").compile_local_map
    on = built("parallelism.compile=true", "model.config.use_local_map=true")
    assert on.compile_local_map and on.use_local_map
    qwen3 = ("model.name=qwen3-ref", "model.flavor=debug")
    on = built("parallelism.compile=true", *qwen3, "model.config.use_local_map=true")
    assert on.compile_local_map and on.use_local_map
    assert not built(*qwen3, "model.config.use_local_map=true").compile_local_map
    # without use_local_map neither model has a region to compile: refused, the key named
    for model in ((), qwen3):
        with pytest.raises(
            ConfigError, match=r"expected model\.config\.use_local_map = true"
        ) as error:
            built("parallelism.compile=true", *model)
        assert error.value.path == "parallelism.compile"
