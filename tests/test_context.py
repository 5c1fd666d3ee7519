"""The parallel context: set/get/reset round trips, a table of bad keys and values, all-or-nothing
updates, dict and YAML round trips, the shipped configs and MindFormers' file forms."""

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from jaxpar.context import (
    FIELD_NAMES,
    ParallelContext,
    current_context,
    get_auto_parallel_context,
    load_config,
    reset_auto_parallel_context,
    save_config,
    set_auto_parallel_context,
)

CONFIGS = Path(__file__).parents[1] / "configs/parallel"
DEFAULTS = ParallelContext()

# One non-default value per key, already in normal form (what get returns).
NON_DEFAULT = [
    ("device_num", 4096),  # more devices than this machine has: planning only
    ("global_rank", 3),
    ("gradients_mean", True),
    ("gradient_fp32_sync", False),
    ("parallel_mode", "auto_parallel"),
    ("search_mode", "dynamic_programming"),
    ("strategy_ckpt_load_file", "/tmp/plans/strategy_stage1.json"),
    ("strategy_ckpt_save_file", "/tmp/plans/out.json"),
    ("full_batch", True),
    ("dataset_strategy", ((8, 1), (8,))),
    ("enable_parallel_optimizer", True),
    ("parallel_optimizer_config", {"gradient_accumulation_shard": False,
                                   "parallel_optimizer_threshold": 24,
                                   "optimizer_weight_shard_size": 4}),
    ("enable_alltoall", True),
    ("all_reduce_fusion_config", (8, 160)),
    ("pipeline_stages", 2),
    ("grad_accumulation_step", 4),
    ("comm_fusion", {"allreduce": {"mode": "index", "config": (2, 20)},
                     "allgather": {"mode": "size", "config": 32},
                     "reducescatter": {"mode": "auto", "config": None}}),
    ("mem_coeff", 4.5),
    ("memory_budget", 2**30),
    ("hardware", "h100-nvlink"),
    ("parallel_config", {"data_parallel": 2, "model_parallel": 4, "vocab_emb_dp": False}),
    ("parameter_broadcast", True),
    ("loss_repeated_mean", False),
]
# full_batch=True is dataset_strategy="full_batch": with split counts it would contradict them
NON_DEFAULT_CTX = ParallelContext(**dict(NON_DEFAULT) | {"full_batch": False})
PARTNERS = {"full_batch": "dataset_strategy", "dataset_strategy": "full_batch"}

# (key, bad value, exception type): each message must name the key.
BAD = [
    ("device_num", 0, ValueError),
    ("device_num", 4097, ValueError),
    ("device_num", 8.0, TypeError),
    ("device_num", True, TypeError),
    ("global_rank", 4096, ValueError),
    ("global_rank", -1, ValueError),
    ("gradients_mean", 1, TypeError),
    ("gradient_fp32_sync", "yes", TypeError),
    ("parallel_mode", "auto", ValueError),
    ("parallel_mode", 2, TypeError),
    ("search_mode", "recursive", ValueError),
    ("strategy_ckpt_load_file", "plans/strategy.yaml", ValueError),
    ("strategy_ckpt_save_file", "/tmp/strategy.ckpt", ValueError),
    ("strategy_ckpt_save_file", 3, TypeError),
    ("full_batch", None, TypeError),
    ("dataset_strategy", "model_parallel", ValueError),
    ("dataset_strategy", ((8, 0),), ValueError),
    ("dataset_strategy", ((8, 1.5),), TypeError),
    ("dataset_strategy", 8, TypeError),
    ("dataset_strategy", (), ValueError),
    ("enable_parallel_optimizer", "true", TypeError),
    ("parallel_optimizer_config", {"threshold": 64}, ValueError),
    ("parallel_optimizer_config", {"parallel_optimizer_threshold": -1}, ValueError),
    ("parallel_optimizer_config", {"optimizer_weight_shard_size": 1}, ValueError),
    ("parallel_optimizer_config", {"gradient_accumulation_shard": 1}, TypeError),
    ("parallel_optimizer_config", [("gradient_accumulation_shard", True)], TypeError),
    ("enable_alltoall", 0, TypeError),
    ("all_reduce_fusion_config", [160, 8], ValueError),
    ("all_reduce_fusion_config", [-1, 8], ValueError),
    ("all_reduce_fusion_config", "8,160", TypeError),
    ("pipeline_stages", 0, ValueError),
    ("pipeline_stages", True, TypeError),
    ("grad_accumulation_step", 0, ValueError),
    ("comm_fusion", {"allgather": {"mode": "index", "config": [1]}}, ValueError),
    ("comm_fusion", {"allreduce": {"mode": "size", "config": -1}}, ValueError),
    ("comm_fusion", {"allreduce": {"mode": "auto", "config": 64}}, ValueError),
    ("comm_fusion", {"allreduce": {"mode": "index", "config": [3, 1]}}, ValueError),
    ("comm_fusion", {"allreduce": {"config": 32}}, ValueError),
    ("comm_fusion", {"broadcast": {"mode": "auto"}}, ValueError),
    ("comm_fusion", {"allreduce": "auto"}, TypeError),
    ("mem_coeff", -0.1, ValueError),
    ("mem_coeff", float("inf"), ValueError),
    ("mem_coeff", "0.1", TypeError),
    ("memory_budget", 0, ValueError),
    ("memory_budget", 0.5, ValueError),  # below a byte
    ("memory_budget", "lots", ValueError),
    ("memory_budget", True, TypeError),
    ("memory_budget", np.array([1, 2]), TypeError),  # numpy's "ambiguous" error before
    ("hardware", "no-such-chip", ValueError),
    ("hardware", 3, TypeError),
    ("parallel_config", {"data_parallel": 0}, ValueError),
    ("parallel_config", {"pipeline_stage": 2}, ValueError),
    ("parallel_config", {"vocab_emb_dp": 1}, TypeError),
    ("comm_fusion", {"allgather": {"mode": "size", "config": 0}}, ValueError),  # MB above 0
    ("comm_fusion", {"openstate": "yes"}, TypeError),
    ("parameter_broadcast", 1, TypeError),
    ("loss_repeated_mean", "true", TypeError),
]


@pytest.fixture(autouse=True)
def _fresh_context():
    reset_auto_parallel_context()
    yield
    reset_auto_parallel_context()


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "parallel.yaml"
    path.write_text(text)
    return path


def test_tables_cover_every_key():
    assert [k for k, _ in NON_DEFAULT] == list(FIELD_NAMES)
    assert {k for k, _, _ in BAD} == set(FIELD_NAMES)
    assert all(getattr(DEFAULTS, k) != v for k, v in NON_DEFAULT)


@pytest.mark.parametrize("key,value", NON_DEFAULT, ids=[k for k, _ in NON_DEFAULT])
def test_set_get_round_trip(key, value):
    set_auto_parallel_context(**{key: value})
    assert get_auto_parallel_context(key) == value
    others = [k for k in FIELD_NAMES if k not in (key, PARTNERS.get(key))]
    assert all(get_auto_parallel_context(k) == getattr(DEFAULTS, k) for k in others)


def test_defaults_follow_mindspore():
    assert DEFAULTS.device_num is None and DEFAULTS.global_rank == 0
    assert DEFAULTS.parallel_mode == "stand_alone"
    assert DEFAULTS.search_mode == "recursive_programming"
    assert DEFAULTS.gradient_fp32_sync is True and DEFAULTS.gradients_mean is False
    assert DEFAULTS.mem_coeff == 0.1 and DEFAULTS.pipeline_stages == 1
    assert DEFAULTS.dataset_strategy == "data_parallel"
    assert DEFAULTS.parallel_optimizer_config["parallel_optimizer_threshold"] == 64


def test_mindspores_older_and_kept_keys_are_read():
    """001's examples set auto_parallel_search_mode (search_mode's older name),
    parameter_broadcast, loss_repeated_mean and comm_fusion's openstate: each was refused
    as an unknown key."""
    set_auto_parallel_context(parallel_mode="auto_parallel",
                              auto_parallel_search_mode="dynamic_programming",
                              parameter_broadcast=True, loss_repeated_mean=False,
                              comm_fusion={"openstate": False,
                                           "allreduce": {"mode": "size", "config": 32}})
    assert get_auto_parallel_context("search_mode") == "dynamic_programming"
    assert get_auto_parallel_context("auto_parallel_search_mode") == "dynamic_programming"
    assert get_auto_parallel_context("comm_fusion")["openstate"] is False
    with pytest.raises(ValueError, match="older name of search_mode; give one of them"):
        set_auto_parallel_context(auto_parallel_search_mode="dynamic_programming",
                                  search_mode="sharding_propagation")
    assert get_auto_parallel_context("parameter_broadcast") is True  # nothing changed
    ctx = ParallelContext.from_dict({"auto_parallel_search_mode": "sharding_propagation"})
    assert ctx.search_mode == "sharding_propagation"


def test_reset_restores_defaults():
    set_auto_parallel_context(**NON_DEFAULT_CTX.to_dict())
    assert current_context() == NON_DEFAULT_CTX
    reset_auto_parallel_context()
    assert current_context() == DEFAULTS


@pytest.mark.parametrize("key,value,exc", BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_bad_value_raises_naming_the_key(key, value, exc):
    with pytest.raises(exc) as info:
        set_auto_parallel_context(**{key: value})
    assert type(info.value) is exc
    assert f"set_auto_parallel_context({key}" in str(info.value)
    assert current_context() == DEFAULTS


@pytest.mark.parametrize("key,value,exc", BAD[:6], ids=[k for k, _, _ in BAD[:6]])
def test_dataclass_rejects_bad_values_too(key, value, exc):
    with pytest.raises(exc, match=re.escape(key)):
        ParallelContext(**{key: value})
    with pytest.raises(exc, match=re.escape(key)):
        dataclasses.replace(DEFAULTS, **{key: value})


def test_unknown_keys_suggest_close_ones():
    with pytest.raises(ValueError, match=r"'paralel_mode'.*Did you mean 'parallel_mode'"):
        set_auto_parallel_context(paralel_mode="auto_parallel")
    with pytest.raises(ValueError, match=r"'serch_mode'.*'search_mode'"):
        get_auto_parallel_context("serch_mode")
    with pytest.raises(TypeError, match="name must be a str"):
        get_auto_parallel_context(3)


def test_bad_call_changes_nothing():
    set_auto_parallel_context(device_num=8, mem_coeff=1.0)
    before = current_context()
    with pytest.raises(ValueError, match="pipeline_stages"):
        set_auto_parallel_context(device_num=16, search_mode="dynamic_programming",
                                  pipeline_stages=0)
    with pytest.raises(ValueError, match="unknown key 'stages'"):
        set_auto_parallel_context(device_num=16, stages=2)
    assert current_context() == before
    assert get_auto_parallel_context("device_num") == 8


def test_inputs_are_normalised():
    set_auto_parallel_context(dataset_strategy=[[4, 2], [4]], all_reduce_fusion_config=[8, 160],
                              parallel_optimizer_config={"parallel_optimizer_threshold": 24},
                              comm_fusion={"allgather": {"mode": "auto"}},
                              strategy_ckpt_save_file=Path("/tmp/s.json"))
    ctx = current_context()
    assert ctx.dataset_strategy == ((4, 2), (4,))
    assert ctx.all_reduce_fusion_config == (8, 160)
    assert ctx.parallel_optimizer_config == {"gradient_accumulation_shard": True,
                                             "parallel_optimizer_threshold": 24,
                                             "optimizer_weight_shard_size": -1}
    assert ctx.comm_fusion == {"allgather": {"mode": "auto", "config": None}}
    assert ctx.strategy_ckpt_save_file == "/tmp/s.json"


def test_full_batch_and_dataset_strategy_move_together(tmp_path):
    # MindSpore: full_batch=True is dataset_strategy="full_batch", False "data_parallel"
    set_auto_parallel_context(full_batch=True)
    assert get_auto_parallel_context("dataset_strategy") == "full_batch"
    set_auto_parallel_context(dataset_strategy="data_parallel")
    assert get_auto_parallel_context("full_batch") is False
    set_auto_parallel_context(dataset_strategy="full_batch")
    assert get_auto_parallel_context("full_batch") is True
    set_auto_parallel_context(full_batch=False)
    assert get_auto_parallel_context("dataset_strategy") == "data_parallel"
    set_auto_parallel_context(dataset_strategy=((8, 1),))
    set_auto_parallel_context(full_batch=False)  # split counts are not full batch: kept
    assert get_auto_parallel_context("dataset_strategy") == ((8, 1),)
    set_auto_parallel_context(full_batch=True)  # the later setting wins
    assert get_auto_parallel_context("dataset_strategy") == "full_batch"
    before = current_context()
    with pytest.raises(ValueError, match=r"full_batch=True, dataset_strategy=\(\(8, 1\),\)\): "
                                         "they disagree"):
        set_auto_parallel_context(full_batch=True, dataset_strategy=((8, 1),))
    with pytest.raises(ValueError, match="they disagree"):
        set_auto_parallel_context(full_batch=False, dataset_strategy="full_batch")
    # full_batch=True beside an explicit "data_parallel" was taken as full batch, silently
    with pytest.raises(ValueError, match="they disagree"):
        set_auto_parallel_context(full_batch=True, dataset_strategy="data_parallel")
    with pytest.raises(ValueError, match="they disagree"):
        ParallelContext.from_dict({"full_batch": True, "dataset_strategy": "data_parallel"})
    assert current_context() == before
    assert ParallelContext(full_batch=True).dataset_strategy == "full_batch"
    assert ParallelContext(dataset_strategy="full_batch").full_batch is True
    path = tmp_path / "p.yaml"
    path.write_text("full_batch: true\n")
    assert load_config(path).dataset_strategy == "full_batch"
    path.write_text("full_batch: true\ndataset_strategy: [[8, 1]]\n")
    with pytest.raises(ValueError, match=r"p\.yaml: .*they disagree"):
        load_config(path)
    path.write_text("full_batch: false\ndataset_strategy: full_batch\n")
    with pytest.raises(ValueError, match=r"p\.yaml: .*they disagree"):
        load_config(path)
    path.write_text("full_batch: true\ndataset_strategy: data_parallel\n")
    with pytest.raises(ValueError, match=r"p\.yaml: .*they disagree"):
        load_config(path)


def test_strategy_files_relative_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    set_auto_parallel_context(strategy_ckpt_save_file="./plans/strategy_stage1.json")
    monkeypatch.chdir("/")
    assert get_auto_parallel_context("strategy_ckpt_save_file") == \
        str(tmp_path / "plans/strategy_stage1.json")
    # MindSpore's examples name the file .ckpt (protobuf there): the error names the .json
    with pytest.raises(ValueError, match=r"protobuf.*'\./strategy_stage1\.json'"):
        set_auto_parallel_context(strategy_ckpt_load_file="./strategy_stage1.ckpt")


def test_context_copies_are_detached():
    set_auto_parallel_context(parallel_config={"data_parallel": 2})
    ctx = current_context()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.device_num = 0
    ctx.parallel_config["data_parallel"] = 0
    get_auto_parallel_context("parallel_config")["model_parallel"] = 0
    assert get_auto_parallel_context("parallel_config") == {"data_parallel": 2}


def test_memory_budget_forms():
    set_auto_parallel_context(memory_budget="hardware", hardware="tpu-v5e")
    assert get_auto_parallel_context("memory_budget") == "hardware"
    set_auto_parallel_context(memory_budget=1.5e9)
    assert get_auto_parallel_context("memory_budget") == 1.5e9
    with pytest.raises(ValueError, match=r"1\.0e\+9"):
        set_auto_parallel_context(memory_budget="1e9")  # how PyYAML reads 1e9
    with pytest.raises(TypeError, match=r"mem_coeff='1e-2'.*1\.0e\+9"):
        set_auto_parallel_context(mem_coeff="1e-2")
    with pytest.raises(ValueError) as info:
        set_auto_parallel_context(memory_budget="lots")
    assert "1.0e+9" not in str(info.value)


def test_dict_round_trips():
    data = NON_DEFAULT_CTX.to_dict()
    assert ParallelContext.from_dict(data) == NON_DEFAULT_CTX
    set_auto_parallel_context(**data)
    assert current_context() == NON_DEFAULT_CTX
    with pytest.raises(ValueError, match="'mesh'"):
        ParallelContext.from_dict({**data, "mesh": None})
    with pytest.raises(TypeError, match="from_dict"):
        ParallelContext.from_dict([("device_num", 8)])


@pytest.mark.parametrize("ctx", [DEFAULTS, NON_DEFAULT_CTX], ids=["defaults", "non_default"])
def test_save_load_round_trip(tmp_path, ctx):
    path = tmp_path / "ctx.yaml"
    save_config(ctx, path)
    assert load_config(path) == ctx
    set_auto_parallel_context(**load_config(path).to_dict())
    assert current_context() == ctx


def test_default_yaml_lists_every_key_with_its_default():
    path = CONFIGS / "default.yaml"
    assert list(yaml.safe_load(path.read_text())) == list(FIELD_NAMES)
    assert load_config(path) == DEFAULTS
    key_lines = [line for line in path.read_text().splitlines() if re.match(r"^\w+:", line)]
    assert len(key_lines) == len(FIELD_NAMES) and all("#" in line for line in key_lines)


def test_mindformers_auto_yaml_loads():
    ctx = load_config(CONFIGS / "mindformers_auto.yaml")
    assert ctx.parallel_mode == "auto_parallel"
    assert ctx.search_mode == "recursive_programming"
    assert ctx.mem_coeff == 0.1 and ctx.pipeline_stages == 1
    assert ctx.enable_parallel_optimizer is True
    assert ctx.parallel_optimizer_config["gradient_accumulation_shard"] is False
    assert ctx.parallel_config == {"auto_pipeline": False, "data_parallel": 8, "model_parallel": 1,
                                   "micro_batch_num": 1, "vocab_emb_dp": True,
                                   "gradient_aggregation_group": 4}


@pytest.mark.parametrize("mode,name", [(0, "data_parallel"), (1, "semi_auto_parallel"),
                                       (2, "auto_parallel"), (3, "hybrid_parallel"),
                                       ("SEMI_AUTO_PARALLEL", "semi_auto_parallel")])
def test_mindformers_parallel_mode(tmp_path, mode, name):
    path = _write(tmp_path, f"use_parallel: true\nparallel:\n  parallel_mode: {mode}\n")
    assert load_config(path).parallel_mode == name


def test_mindformers_reference_snippet(tmp_path):
    path = _write(tmp_path, "use_parallel: True\nparallel:\n  parallel_mode: 2\n"
                            "  search_mode: \"recursive_programming\"\n  auto_pipeline: True\n"
                            "parallel_config:\n  mem_coeff: 4.5\n  pipeline_stage: 4\n"
                            "  micro_batch_num: 8\n")
    ctx = load_config(path)
    assert (ctx.parallel_mode, ctx.mem_coeff, ctx.pipeline_stages) == ("auto_parallel", 4.5, 4)
    assert ctx.parallel_config == {"auto_pipeline": True, "micro_batch_num": 8}


def test_use_parallel(tmp_path):
    assert load_config(_write(tmp_path, "use_parallel: true\n")).parallel_mode == "data_parallel"
    off = "use_parallel: false\nparallel:\n  parallel_mode: 2\n"
    assert load_config(_write(tmp_path, off)).parallel_mode == "stand_alone"


def test_parallel_context_mapping(tmp_path):
    path = _write(tmp_path, "parallel_context:\n  device_num: 8\n  search_mode: "
                            "sharding_propagation\n  dataset_strategy: [[8, 1], [8]]\n")
    ctx = load_config(path)
    assert (ctx.device_num, ctx.search_mode) == (8, "sharding_propagation")
    assert ctx.dataset_strategy == ((8, 1), (8,))


@pytest.mark.parametrize("text,needle", [
    ("device_numb: 8\n", "device_numb"),
    ("device_num: eight\n", "device_num"),
    ("gradients_mean: 1\n", "gradients_mean"),
    ("parallel:\n  parallel_mode: 5\n", "parallel.parallel_mode"),
    ("parallel:\n  mem_coef: 0.1\n", "parallel.mem_coef"),
    ("parallel: [1, 2]\n", "parallel"),
    ("parallel_config:\n  model_parallel: 0\n", "model_parallel"),
    ("mem_coeff: 1e-2\n", "mem_coeff"),
    ("mem_coeff: 0.1\nparallel_config:\n  mem_coeff: 0.2\n", "mem_coeff"),
    ("use_parallel: yes please\n", "use_parallel"),
    ("parallel_context:\n  device_num: 8\nmem_coeff: 0.1\n", "parallel_context"),
    ("device_num: [8\n", "not valid YAML"),
    ("- 8\n", "mapping"),
])
def test_bad_yaml_names_file_and_key(tmp_path, text, needle):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError) as info:
        load_config(path)
    assert str(path) in str(info.value) and needle in str(info.value)


def test_missing_file_and_bad_save_arguments(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(TypeError, match=r"load_config\(path=3\): pass the path of a YAML"):
        load_config(3)
    with pytest.raises(TypeError, match="ParallelContext"):
        save_config({"device_num": 8}, tmp_path / "x.yaml")
    with pytest.raises(ValueError, match=r"save_config\(path=...\).*directory .* does not exist"):
        save_config(current_context(), tmp_path / "absent" / "x.yaml")


def test_unknown_key_lists_each_known_key_once(tmp_path):
    with pytest.raises(ValueError) as info:
        load_config(_write(tmp_path, "zzz: 1\n"))
    known = str(info.value).split("Known keys: ")[1]
    assert known.count("'parallel_config'") == 1


def test_the_yaml_hint_is_given_for_numbers_in_e_notation_only():
    with pytest.raises(TypeError) as info:
        set_auto_parallel_context(device_num="8")
    assert "YAML" not in str(info.value)
    with pytest.raises(TypeError, match=r"YAML reads 1e9 as text"):
        set_auto_parallel_context(device_num="8e0")


def test_shard_reads_the_context_for_the_settings_it_is_not_given():
    """shard() ignored the context: set_auto_parallel_context(parallel_mode="auto_parallel",
    search_mode=..., device_num=4, memory_budget=...) planned with sharding propagation on
    every device and no budget, silently (AutoParallel read it)."""
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh

    import jaxpar

    def fn(x):
        return jnp.tanh(x) * 2

    plain = jaxpar.shard(fn).opts
    assert (plain.search_mode, plain.mesh.size, plain.mem_coeff, plain.memory_budget) == \
        ("sharding_propagation", 8, 0.1, None)
    set_auto_parallel_context(search_mode="dynamic_programming", device_num=4, mem_coeff=2.0,
                              hardware="h100-nvlink", memory_budget=1e9)
    semi = jaxpar.shard(fn).opts  # the search mode only under parallel_mode auto_parallel
    assert (semi.search_mode, semi.mesh.size, semi.mem_coeff, semi.memory_budget,
            semi.hardware) == ("sharding_propagation", 4, 2.0, 1e9, "h100-nvlink")
    set_auto_parallel_context(parallel_mode="auto_parallel")
    auto = jaxpar.shard(fn).opts
    assert auto.search_mode == "dynamic_programming"
    given = jaxpar.shard(fn, mesh=jaxpar.make_mesh(8), search_mode="recursive_programming",
                         mem_coeff=0.0, memory_budget=2e9, hardware="cpu").opts
    assert (given.search_mode, given.mesh.size, given.mem_coeff, given.memory_budget,
            given.hardware) == ("recursive_programming", 8, 0.0, 2e9, "cpu")
    set_auto_parallel_context(memory_budget=10)  # read: the plan cannot fit it
    with pytest.raises(ValueError, match="memory_budget=10 bytes per device cannot be met"):
        jaxpar.shard(fn).plan(jnp.ones((8, 8)))
    set_auto_parallel_context(device_num=64, memory_budget=None)  # a larger cluster: plans
    assert isinstance(jaxpar.shard(fn).mesh, AbstractMesh)


def test_shard_refuses_the_contexts_pipeline_stages():
    """shard() planned one program over every device under pipeline_stages=2 without a word
    (AutoParallel refuses it)."""
    import jaxpar

    set_auto_parallel_context(pipeline_stages=2)
    with pytest.raises(NotImplementedError, match=r"pipeline_stages=2.*pipeline_stages=1\)"):
        jaxpar.shard(lambda x: x * 2)
    set_auto_parallel_context(pipeline_stages=1)
    assert jaxpar.shard(lambda x: x * 2).opts.search_mode == "sharding_propagation"
