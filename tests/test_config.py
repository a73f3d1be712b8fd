"""The configuration groups: every field is a flag with help and a default on `--help`,
flat flag names round-trip through the groups, and a run directory's config.json written
before the groups existed still loads and resumes."""

import dataclasses
import json
import types
import typing

import pytest

from jdist.config import TrainConfig, group_fields, locate, make_parser, parse_args, result_flags
from jdist.train import resume

# A run directory's config.json "train" object as the flat TrainConfig of before the groups
# wrote it (every flag at its default but these), in that TrainConfig's field order.
OLD_CONFIG_JSON = {
    "model": "tiny", "mesh": "dp=2,fsdp=2", "steps": 6, "batch_size": 8, "seq_len": 32,
    "lr": 0.003, "warmup": 30, "weight_decay": 0.1, "clip_norm": 1.0, "seed": 0,
    "compute_dtype": "auto", "run_dir": "runs/old", "eval_every": 100, "eval_batches": 4,
    "log_every": 10, "rules": "", "sequence_parallel": False, "cp_strategy": "ring",
    "attention": "auto", "loss": "chunked", "microbatches": 0, "pp_schedule": "1f1b",
    "pp_virtual_stages": 1, "pp_show_schedule": False, "zero": 2, "grad_accum": 2,
    "remat": "none", "prefetch": "auto", "tp_halves": False, "collective_matmul": "auto",
    "fp8": "off", "offload": "none", "offload_dir": "",
    "dry_run": False,
    "device_memory_gb": 0.0,
    "text_column": "text",
    "peak_tflops": 0.0, "data": "", "data_dtype": "uint16", "tokenizer": "", "init_from": "",
    "packing": "none", "data_format": "text", "allow_truncation": False, "cpu_devices": 0,
    "target": "", "hosts": 1,
    "lora_rank": None, "lora_alpha": 16.0, "lora_targets": "", "quantize_base": "none",
    "double_quant": False, "save_base": False, "n_layers": None, "d_model": None,
    "n_heads": None, "n_kv_heads": None, "d_ff": None, "vocab_size": None,
    "tie_embeddings": None, "qk_norm": None, "sliding_window": None, "attention_sinks": None,
    "full_attention_every": None, "nope_every": None,
    "first_dense_layers": None, "dense_d_ff": None,
    "n_experts": None, "top_k": None, "moe_routing": None,
    "shared_d_ff": None, "shared_gate": None, "capacity_factor": None, "aux_loss_weight": None,
    "z_loss_weight": None, "router_bias_rate": None,
    "coordinator": "", "num_processes": 0, "process_id": -1, "checkpoint_every": 3,
    "no_final_checkpoint": False, "keep": 3, "resume": "auto", "on_nan": "stop",
    "inject_nan_at_step": 0,
    "verify_checkpoint": "full", "tensorboard": False, "profile_steps": "",
    "straggler_every": 10, "straggler_threshold": 1.5, "straggler_windows": 3,
    "check_replicas_every": 100, "recompute_check_every": 1000,
    "inject_corruption_at_step": 0, "inject_straggler": "",
    "optimizer": "adamw", "schedule": "cosine", "decay_fraction": 0.2,  # newer: Muon, WSD
    "n_expert_groups": None, "topk_groups": None, "routed_scale": None,  # newer: DeepSeek
    "kv_lora_rank": None, "mtp_depth": None, "mtp_weight": None,
    "moe_overlap": "auto",  # newer: MoE all-to-alls in pieces
    "expert_matmul": "auto",  # newer: grouped expert matmuls as Pallas kernels
}
# The flags that resume.RESULT_FLAGS listed by hand before the "result" metadata.
OLD_RESULT_FLAGS = {"seed", "batch_size", "seq_len", "steps", "lr", "warmup", "weight_decay",
                    "clip_norm", "data", "data_dtype", "init_from", "tokenizer", "packing",
                    "data_format", "lora_rank", "lora_alpha", "lora_targets", "quantize_base",
                    "double_quant",
                    "text_column",  # newer: the column of .parquet/.arrow data
                    "optimizer", "schedule", "decay_fraction"}  # newer: Muon and WSD


def a_value(field: dataclasses.Field, hint):
    """A value other than the field's default, and its command-line text (None: a switch)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is bool:
        return True, None
    if typing.get_origin(hint) is typing.Literal:
        value = next(v for v in typing.get_args(hint) if v != field.default)
    else:
        value = {int: 7, float: 2.5, str: "x"}[hint]
    return value, str(value)


FIELDS = [(group, field) for group, field in group_fields()]


@pytest.mark.parametrize("group, field", FIELDS, ids=[f.name for _, f in FIELDS])
def test_every_field_is_a_flag_with_help_that_round_trips(group, field):
    assert field.metadata.get("help"), f"{field.name} has no help"
    assert isinstance(field.metadata.get("result"), bool)
    hint = typing.get_type_hints(type(getattr(TrainConfig(), group)))[field.name]
    value, text = a_value(field, hint)
    name = field.metadata.get("flag", field.name)
    argv = ["--" + name.replace("_", "-")] + ([text] if text is not None else [])
    config = parse_args(argv)
    assert getattr(getattr(config, group), field.name) == value
    assert config.flat()[name] == value
    assert TrainConfig.of(**config.flat()) == config
    assert TrainConfig.of(**{name: value}) == config


def test_flag_names_are_unique_and_of_refuses_unknown_ones():
    assert len(locate()) == len(FIELDS)
    with pytest.raises(TypeError, match="no_such_flag"):
        TrainConfig.of(no_such_flag=1)
    with pytest.raises(AttributeError, match="config.memory.zero"):
        TrainConfig().zero  # noqa: B018 - the flat name says where it went


def test_help_is_grouped_and_shows_defaults():
    text = make_parser().format_help()
    for group in dataclasses.fields(TrainConfig):
        assert f"\n{group.name}:\n" in text, group.name
    memory = text.split("\nmemory:\n", 1)[1].split("\noptim:\n")[0]
    assert "--grad-accum" in memory and "--lr" not in memory
    zero = " ".join(memory.split("--zero", 1)[1].split("--grad-accum")[0].split())
    assert zero.endswith("+parameters (default: 0)")
    assert "(default: fsdp=-1)" in " ".join(text.split())


def test_result_flags_come_from_the_metadata():
    assert set(result_flags()) == OLD_RESULT_FLAGS
    assert resume.RESULT_FLAGS == result_flags()


def test_config_json_from_before_the_groups_loads_and_is_written_the_same():
    config = TrainConfig.of(**json.loads(json.dumps(OLD_CONFIG_JSON)))
    assert (config.model.preset, config.memory.zero, config.memory.grad_accum,
            config.checkpoint.run_dir, config.data.batch_size) == ("tiny", 2, 2, "runs/old", 8)
    assert config.flat() == OLD_CONFIG_JSON  # same keys, same values
    assert json.loads(json.dumps(config.flat())) == OLD_CONFIG_JSON
    # An older file lacks newer flags: they were at their defaults.
    older = {k: v for k, v in OLD_CONFIG_JSON.items() if k != "inject_straggler"}
    assert TrainConfig.of(**older) == config


def test_a_checkpoint_written_before_the_groups_is_compatible(tmp_path):
    from jdist import checkpoint as ckpt
    from jdist.step.from_flags import model_of

    config = TrainConfig.of(**OLD_CONFIG_JSON)
    model = model_of(config)
    meta = {"config": OLD_CONFIG_JSON, "model": dataclasses.asdict(model),
            "mesh": {"data": 2, "fsdp": 2}}
    found = ckpt.Found(tmp_path, 3, meta)
    resume.check_compatible(found, config, model)
    resume.check_numerics(found, config, model, {"data": 2, "fsdp": 2})
    from jdist.errors import ConfigError

    with pytest.raises(ConfigError, match="--seq-len 32 but this run has --seq-len 64"):
        resume.check_compatible(found, config.replace(seq_len=64), model)
