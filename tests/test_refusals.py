"""Refusals before launch (trainer/launch/refusal.py): each prints one line with its category, the key
and a fix, exits 2, and never shows a traceback. A table of bad configs through the real command line
(`trainyard dry-run configs/demo.yaml ...`) on one real shard index built once for the module.

Run: .venv/bin/python -m pytest -q tests/test_refusals.py
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from cli.main import main
from ops.clips.plan import ShardConfig
from ops.curation import rights
from ops.publish import paths
from tests.helpers import write_shards
from trainer.launch.config import LiteralSecretError
from trainer.launch.memory import MemoryBudgetExceeded
from trainer.launch.refusal import CATEGORIES, Refusal

CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "demo.yaml")


@pytest.fixture(scope="module")
def shards(demo_validation, tmp_path_factory):
    """(plan, index) of the demo's shards, in a folder outside any <data root>/shards/: the rights ledger
    read for it is the test's own data root (ops.curation.rights.data_root_of_index)."""
    return write_shards(demo_validation, ShardConfig(encoding="decoded"), tmp_path_factory.mktemp("refusals"))


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, str]:
    """Config files a researcher gets wrong, by name."""
    folder = tmp_path_factory.mktemp("configs")
    files = {"list": "- preset: demo_cpu\n- train: {steps: 2}\n",
             "duplicate": "preset: demo_cpu\ntrain: {steps: 2}\ntrain: {steps: 3}\n",
             "preset_list": "preset: [demo_cpu]\n"}
    for name, text in files.items():
        (folder / f"{name}.yaml").write_text(text)
    return {"demo": CONFIG, "missing": str(folder / "no_such.yaml"),
            **{name: str(folder / f"{name}.yaml") for name in files}}


def _data(index) -> list[str]:
    return ["--set", "data.source=shards", "--set", f"data.shard_index={index.directory}",
            "--set", f"data.manifest_version={index.manifest_version}", "--set", "data.num_workers=0"]


def _sets(*overrides: str) -> list[str]:
    return [arg for override in overrides for arg in ("--set", override)]


# (row id, config file, shard data?, extra arguments, environment, category, key named, fix words)
ROWS = [
    ("unknown_key", "demo", True, _sets("data.batch_sise=4"), {}, "config", "data.batch_sise",
     "rename data.batch_sise to data.batch_size"),
    ("wrong_type", "demo", True, _sets("train.steps=abc"), {}, "config", "train.steps",
     "give train.steps a whole number"),
    ("bad_choice", "demo", True, _sets("train.precision=fp8"), {}, "config", "train.precision",
     "set train.precision to one of ('auto', 'fp32', 'bf16', 'fp16')"),
    ("out_of_range", "demo", True, _sets("train.steps=0"), {}, "config", "train.steps", "set train.steps so it is >= 1"),
    ("bad_preset", "demo", True, _sets("preset=demo_gpu"), {}, "config", "preset", "did you mean preset=demo_cpu"),
    ("preset_not_a_name", "preset_list", True, [], {}, "config", "preset", "use one of demo_cpu, tiny_cpu"),
    ("malformed_override", "demo", True, _sets("train.steps"), {}, "config", "train.steps",
     "--set section.field=value"),
    ("config_file_missing", "missing", False, [], {}, "config", "no_such.yaml", "configs/demo.yaml"),
    ("yaml_not_a_mapping", "list", False, [], {}, "config", "list.yaml", "write it as a mapping"),
    ("yaml_key_twice", "duplicate", False, [], {}, "config", "duplicate.yaml", "each key once"),
    ("batch_not_divisible", "demo", True, ["--world-size", "3"], {}, "config", "data.batch_size",
     "set data.batch_size to a multiple of 3"),
    ("parallelism_none_on_two", "demo", True, [*_sets("train.parallelism=none"), "--world-size", "2"], {}, "config",
     "train.parallelism", "set train.parallelism=ddp"),
    ("fault_rank_beyond_world", "demo", True, [*_sets("faults.exit_rank=4", "faults.exit_at_step=1"),
                                               "--world-size", "2"], {}, "config", "faults.exit_rank",
     "set faults.exit_rank below 2"),
    ("checkpoint_store_unnamed", "demo", True, _sets("stage.checkpoint_io=store"), {}, "config", "stage.checkpoint_io",
     "export TRAINYARD_CHECKPOINT_ROOT="),
    ("precision_unsupported", "demo", True, _sets("train.precision=bf16"), {"unsupported_autocast": True}, "config",
     "train.precision", "use 'fp32' for train.precision"),
    ("shards_without_index", "demo", False, _sets("data.source=shards"), {}, "data", "data.shard_index",
     "set data.shard_index to a shard index folder"),
    ("shard_index_missing", "demo", True, _sets("data.shard_index=/nonexistent/shards/v1"), {}, "data",
     "data.shard_index", "materialize the shard_index asset"),
    ("shard_index_damaged", "demo", True, [], {"damage": True}, "data", "index.json", "materialize that version again"),
    ("clip_shape_mismatch", "demo", True, _sets("data.height=32"), {}, "data", "data.height",
     "set data.clip_frames=8 data.height=64 data.width=64"),
    ("manifest_mismatch", "demo", True, _sets("data.manifest_version=" + "0" * 20), {}, "data",
     "data.manifest_version", "set data.manifest_version="),
    ("revoked_asset", "demo", True, [], {"revoke": True}, "rights", "data.shard_index", "materialize validated_manifest"),
    ("memory_over_budget", "demo", True, _sets("train.max_memory_bytes=1000000"), {}, "memory",
     "train.max_memory_bytes", "set train.activation_checkpointing=true"),
    ("slurm_partition_newline", "demo", False, ["--slurm"], {"TRAINYARD_SLURM_PARTITION": "gpu\n#SBATCH --x"},
     "cluster", "SlurmLauncher.partition", "set TRAINYARD_SLURM_PARTITION to a valid value (e.g. 'debug' or"),
    ("slurm_nodes_not_a_number", "demo", False, ["--slurm"], {"TRAINYARD_SLURM_NODES": "two"}, "cluster",
     "TRAINYARD_SLURM_NODES", "set TRAINYARD_SLURM_NODES to a whole number"),
    ("literal_secret", "demo", True, _sets("data.storage_token=hunter2-literal"), {}, "credentials",
     "data.storage_token", "data.storage_token=${env:MY_TOKEN}"),
    ("secret_variable_unset", "demo", True, _sets("data.storage_token=${env:TRAINYARD_TEST_UNSET_TOKEN}"), {},
     "credentials", "data.storage_token", "export TRAINYARD_TEST_UNSET_TOKEN"),
]


def test_the_table_covers_every_category_and_at_least_15_configs() -> None:
    assert len(ROWS) >= 15 and {row[5] for row in ROWS} == set(CATEGORIES)


@pytest.mark.parametrize(("config", "with_data", "extra", "environment", "category", "key", "fix"),
                         [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_a_bad_config_is_refused_in_one_line_naming_the_key_and_a_fix(
        shards, configs, capsys, monkeypatch, tmp_path, config, with_data, extra, environment, category, key, fix) -> None:
    plan, index = shards
    for name, value in environment.items():
        if name == "damage":  # a copy of the index whose index.json was edited after publication
            import shutil

            damaged = shutil.copytree(index.directory, tmp_path / "damaged")
            info = damaged / "index.json"
            info.write_text(info.read_text().replace('"num_samples": ', '"num_samples": 1', 1))
            extra = [*extra, *_sets(f"data.shard_index={damaged}")]
        elif name == "revoke":  # the first asset the index holds, revoked in this test's data root
            rights.revoke(paths.data_root(), plan.table.column("asset_id")[0].as_py(), reason="takedown")
        elif name == "unsupported_autocast":
            import trainer.precision

            monkeypatch.setattr(trainer.precision, "autocast_supported", lambda device_type, dtype: False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.delenv("TRAINYARD_TEST_UNSET_TOKEN", raising=False)
    code = main(["dry-run", configs[config], *(_data(index) if with_data else []), *extra, "--batches", "0"])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert "Traceback" not in out + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and err.count("\n") == 1, err
    assert lines[0].startswith(f"trainyard: refused ({category}) "), lines[0]
    found, separator, fixed = lines[0].partition("; fix: ")
    assert separator and key in found, lines[0]
    assert fix in fixed, lines[0]
    assert "hunter2-literal" not in out + err


def test_a_newline_in_a_user_value_stays_on_one_line(shards, capsys) -> None:
    _, index = shards
    refusal = Refusal("data", found="data.shard_index /a\nb\r\u2028c cannot be read", fix="set it\nagain",
                      key="data.shard_index\n")
    assert len(str(refusal).splitlines()) == 1 and "/a\\nb\\r\\u2028c" in str(refusal)
    assert str(refusal) == "data: data.shard_index /a\\nb\\r\\u2028c cannot be read; fix: set it\\nagain"
    code = main(["dry-run", CONFIG, *_data(index), "--set", "data.shard_index=/nowhere/a\nTraceback (fake)",
                 "--batches", "0"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "/nowhere/a\\nTraceback (fake)" in err, err


def test_refusals_keep_their_fields_through_pickle_and_stay_value_errors() -> None:
    for refusal in (LiteralSecretError("--set: data.storage_token is a secret field", key="data.storage_token"),
                    MemoryBudgetExceeded("estimated 2 GiB exceeds train.max_memory_bytes 1 GiB", "use fsdp")):
        copy = pickle.loads(pickle.dumps(refusal))
        assert type(copy) is type(refusal) and isinstance(copy, ValueError)
        assert (copy.category, copy.found, copy.fix, copy.key) == (refusal.category, refusal.found, refusal.fix,
                                                                    refusal.key)
    with pytest.raises(TypeError, match="category"):
        Refusal("disk", found="x", fix="y")
