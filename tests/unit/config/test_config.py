"""Config: defaults, validation messages that name file and field, --set, seed policies, overrides."""

import pytest
import yaml

from healthcheck.config import (
    RANK0_SEED_OFFSET,
    ProbeConfig,
    dump_yaml,
    json_schema,
    load_config,
    resolve_for_rank,
)
from healthcheck.errors import ConfigError, ExitCode


def write(tmp_path, text):
    path = tmp_path / "probe.yaml"
    path.write_text(text)
    return path


def error_of(*args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    assert info.value.exit_code == ExitCode.INVALID_INPUT
    message = info.value.message
    assert "\n" not in message
    return message


def test_default_is_the_embedded_probe():
    config = load_config()
    assert config.model.name == "tiny-gpt2"
    assert config.data.source == "synthetic"
    assert config.distributed.nproc == 8
    assert config.data.max_length == 1024
    assert config.data.response_only_loss is True
    assert config.model.trust_remote_code is False


def test_unknown_key_names_file_and_field(tmp_path):
    message = error_of(write(tmp_path, "train:\n  stepz: 3\n"))
    assert message.startswith(str(tmp_path / "probe.yaml"))
    assert "train.stepz: unknown key" in message


def test_wrong_type_names_field_and_value(tmp_path):
    message = error_of(write(tmp_path, "train:\n  lr: fast\n"))
    assert "train.lr" in message and "'fast'" in message


def test_nproc_below_two(tmp_path):
    assert "distributed.nproc: must be >= 2" in error_of(write(tmp_path, "distributed: {nproc: 1}\n"))


def test_float16_weights_are_refused_with_the_reason(tmp_path):
    # The probe's AdamW on fp16 weights: eps and small gradients' squares are 0, so the first update is inf (the
    # default probe went non-finite on every rank at step 1). Refused on every rank, not left to a NaN verdict.
    for message in (error_of(write(tmp_path, "model: {dtype: float16}\n")),
                    error_of(None, ["rank_overrides={1: {model: {dtype: float16}}}"])):
        assert "model.dtype: float16 weights cannot train under the probe's AdamW" in message and "bfloat16" in message
    assert load_config(None, ["model.dtype=bfloat16"]).model.dtype == "bfloat16"


def test_rank_override_outside_world():
    message = error_of(None, ["distributed.nproc=4", "rank_overrides={4: {train: {seed: 1}}}"])
    assert "rank_overrides: rank 4 is outside the world (nproc=4)" in message


def test_a_gradient_source_the_config_rules_out_is_refused():
    assert load_config(None, ["metrics.local_from=grads"]).metrics.local_from == "grads"
    assert load_config(None, ["metrics.local_from=buckets", "metrics.direction=exact"]).metrics.local_from == "buckets"
    refused = {
        ("metrics.local_from=grads", "metrics.direction=exact"): "'grads' is for sketch mode",
        ("metrics.local_from=grads", "distributed.gradient_as_bucket_view=true"): "with distributed.gradient_as_bucket_view",
        ("metrics.local_from=buckets", "distributed.strategy=fsdp"): "distributed.strategy=fsdp takes 'auto'",
        ("metrics.local_from=grad",): "metrics.local_from: Input should be 'auto', 'buckets' or 'grads'",
    }
    for sets, expected in refused.items():
        assert expected in error_of(None, list(sets)), sets


def test_hsdp_replicas_are_a_sharded_sketch_layout_that_divides_the_workers():
    config = load_config(None, ["distributed.strategy=fsdp", "distributed.replicas=2", "distributed.nproc=4"])
    assert config.distributed.replicas == 2 and config.baseline_path().name == "default-hsdp.json"
    assert load_config(None, ["distributed.strategy=fsdp"]).baseline_path().name == "default-fsdp.json"
    refused = {
        ("distributed.replicas=2",): "distributed.replicas: 2 replicas is HSDP, a layout of distributed.strategy=fsdp",
        ("distributed.strategy=fsdp", "distributed.replicas=2", "metrics.direction=exact"): "HSDP is measured in sketch mode",
        ("distributed.strategy=fsdp", "distributed.replicas=3"): "distributed.replicas: 3 does not divide distributed.nproc=8",
        ("distributed.replicas=0",): "distributed.replicas: Input should be greater than or equal to 1",
    }
    for sets, expected in refused.items():
        assert expected in error_of(None, list(sets)), sets


def test_rank_override_bad_field_is_named():
    assert "rank_overrides.1.train.sed: unknown key" in error_of(None, ["rank_overrides={1: {train: {sed: 1}}}"])
    assert "cannot override distributed" in error_of(None, ["rank_overrides={1: {distributed: {nproc: 3}}}"])


@pytest.mark.parametrize("text", ["[1, 2]\n", "train: [\n", "!!python/object/apply:os.system ['true']\n"])
def test_bad_yaml_is_one_line(tmp_path, text):
    message = error_of(write(tmp_path, text))
    assert str(tmp_path / "probe.yaml") in message


def test_missing_file():
    assert "config file not found" in error_of("/nonexistent/probe.yaml")


def test_set_overrides_and_validates(tmp_path):
    config = load_config(write(tmp_path, "train: {steps: 30}\n"), ["train.steps=12", "metrics.direction=exact"])
    assert config.train.steps == 12 and config.metrics.direction == "exact"
    assert "train.steps" in error_of(None, ["train.steps=abc"])
    assert "expected key.path=value" in error_of(None, ["train.steps"])


def test_show_output_round_trips(tmp_path):
    config = load_config(None, ["seed_policy=per_rank", "rank_overrides={2: {train: {lr: 0.01}}}"])
    path = write(tmp_path, dump_yaml(config))
    assert load_config(path) == config
    assert yaml.safe_load(path.read_text())["rank_overrides"] == {2: {"train": {"lr": 0.01}}}


def test_schema_exports_descriptions():
    schema = json_schema()
    assert schema["additionalProperties"] is False
    train = schema["$defs"]["TrainConfig"]["properties"]
    assert all("description" in field for field in train.values())


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("shared", [42, 42, 42, 42]),
        ("rank0_differs", [42 + RANK0_SEED_OFFSET, 42, 42, 42]),
        ("per_rank", [42, 43, 44, 45]),
    ],
)
def test_seed_policy_resolves_per_rank(policy, expected):
    config = ProbeConfig(seed_policy=policy, distributed={"nproc": 4})
    seeds = [resolve_for_rank(config, rank).train.seed for rank in range(4)]
    assert seeds == expected
    # data_seed follows the effective seed unless set, so the sampler really changes too.
    assert [resolve_for_rank(config, rank).train.data_seed for rank in range(4)] == expected


def test_explicit_override_beats_policy_and_keeps_data_seed():
    config = ProbeConfig(seed_policy="per_rank", train={"data_seed": 7}, rank_overrides={1: {"train": {"seed": 1041}}})
    assert resolve_for_rank(config, 1).train.seed == 1041
    assert resolve_for_rank(config, 1).train.data_seed == 7
    assert resolve_for_rank(config, 2).train.seed == 44


@pytest.mark.parametrize("name", ["../escape", "a/b", "", ".hidden"])
def test_probe_name_cannot_escape(name):
    assert "name" in error_of(None, [f"name={name!r}" if name else "name=''"])
