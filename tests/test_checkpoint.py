"""Sharded checkpoints: save on an 8-device mesh, restore onto other meshes, steps and errors."""

import json
import logging
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.train import checkpoint as ckpt
from jaxpar.train import checkpoint_steps, latest_step, restore_checkpoint, save_checkpoint

CHECKSUMS = "_CHECKSUMS.json"
SPECS_8 = {"w1": P("data", "model"), "w2": P(None, "model"), "w3": P("data"), "b": P("model")}


@pytest.fixture(scope="module")
def mesh8() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


@pytest.fixture(scope="module")
def mesh4() -> Mesh:
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))


@pytest.fixture
def no_orbax_restore(monkeypatch):
    """Fail the test if restore_checkpoint reaches orbax's restore: errors must come first."""
    def reached(*args, **kwargs):
        raise AssertionError("orbax restore was called; the error should have been raised first")
    monkeypatch.setattr(ocp.StandardCheckpointer, "restore", reached)


def _train_state(mesh: Mesh, seed: int = 0) -> dict:
    """Params and adamw state after one update (mu, nu and count all non-trivial)."""
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = {"w1": (16, 32), "w2": (16, 32), "w3": (16, 32), "b": (32,)}
    params = {name: jax.device_put(jax.random.normal(key, shapes[name]),
                                   NamedSharding(mesh, SPECS_8[name]))
              for key, name in zip(keys, shapes, strict=True)}
    opt = optax.adamw(1e-2)
    opt_state = opt.init(params)
    grads = jax.tree.map(lambda p: 0.1 * p + 1.0, params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return {"params": optax.apply_updates(params, updates), "opt_state": opt_state, "step": 1}


def _by_rank(tree, mesh: Mesh, specs: dict[int, P]):
    """A NamedSharding per array leaf chosen by its rank; None for python scalars."""
    def pick(leaf):
        return None if isinstance(leaf, int) else NamedSharding(mesh, specs[np.ndim(leaf)])
    return jax.tree.map(pick, tree)


def _assert_identical(restored, original) -> None:
    assert jax.tree.structure(restored) == jax.tree.structure(original)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(original), strict=True):
        assert np.asarray(got).dtype == np.asarray(want).dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_restores_bit_identically_onto_the_same_shardings(tmp_path, mesh8):
    state = _train_state(mesh8)
    save_checkpoint(tmp_path / "ckpt", state)
    restored = restore_checkpoint(tmp_path / "ckpt", state)
    _assert_identical(restored, state)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        if isinstance(want, jax.Array):
            assert got.sharding == want.sharding
    assert restored["step"] == 1 and isinstance(restored["step"], int)


def test_restores_onto_a_four_device_mesh_with_other_specs(tmp_path, mesh8, mesh4):
    state = _train_state(mesh8)
    save_checkpoint(tmp_path / "ckpt", state)
    specs = {0: P(), 1: P("dp"), 2: P("tp", "dp")}
    shardings = _by_rank(state, mesh4, specs)
    restored = restore_checkpoint(tmp_path / "ckpt", state, shardings=shardings)
    _assert_identical(restored, state)
    w1 = restored["params"]["w1"]
    assert w1.sharding == NamedSharding(mesh4, P("tp", "dp"))
    assert w1.sharding.mesh.devices.size == 4 and w1.addressable_shards[0].data.shape == (8, 16)
    assert restored["opt_state"][0].mu["b"].sharding == NamedSharding(mesh4, P("dp"))


def test_restores_into_abstract_targets_with_shardings(tmp_path, mesh8, mesh4):
    state = _train_state(mesh8)
    save_checkpoint(tmp_path / "ckpt", state)
    sharding = NamedSharding(mesh4, P(None, "tp"))

    def abstract(x):
        if isinstance(x, int):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding if x.ndim == 2 else None)
    target = jax.tree.map(abstract, state)
    restored = restore_checkpoint(tmp_path / "ckpt", target)
    _assert_identical(restored, state)
    assert restored["params"]["w3"].sharding == sharding
    assert restored["params"]["b"].sharding == SingleDeviceSharding(jax.devices()[0])


def test_placement_precedence(tmp_path, mesh8, mesh4):
    state = {"w": _train_state(mesh8)["params"]["w1"], "host": np.arange(6, dtype=np.float32)}
    save_checkpoint(tmp_path / "ckpt", state)
    bare = {"w": jax.ShapeDtypeStruct((16, 32), jnp.float32), "host": np.zeros(6, np.float32)}
    on_mesh = restore_checkpoint(tmp_path / "ckpt", bare, mesh=mesh4)
    assert on_mesh["w"].sharding == NamedSharding(mesh4, P())
    assert on_mesh["host"].sharding == NamedSharding(mesh4, P())
    on_host = restore_checkpoint(tmp_path / "ckpt", bare)
    assert isinstance(on_host["host"], np.ndarray)
    assert on_host["host"].tolist() == [0, 1, 2, 3, 4, 5]
    assert on_host["w"].sharding == SingleDeviceSharding(jax.devices()[0])
    explicit = restore_checkpoint(tmp_path / "ckpt", state, mesh=mesh4, shardings=P("tp"))
    assert explicit["w"].sharding == NamedSharding(mesh4, P("tp"))
    _assert_identical(explicit, state)


def test_optax_step_counter_round_trips(tmp_path, mesh8):
    count = _train_state(mesh8)["opt_state"][0].count
    assert count.dtype == jnp.int32 and count.shape == ()
    save_checkpoint(tmp_path / "ckpt", {"count": count})
    restored = restore_checkpoint(tmp_path / "ckpt", {"count": jax.ShapeDtypeStruct((), jnp.int32)})
    assert restored["count"].dtype == jnp.int32 and int(restored["count"]) == 1


def test_numpy_scalars_round_trip(tmp_path):
    # Saved, but restoring one failed inside orbax ("Unsupported type: numpy.float32").
    state = {"w": jnp.ones(4), "lr": np.float32(0.1), "n": np.int64(3)}
    save_checkpoint(tmp_path / "ck", state)
    back = restore_checkpoint(tmp_path / "ck", state)
    assert type(back["lr"]) is np.float32 and back["lr"] == np.float32(0.1)
    assert type(back["n"]) is np.int64 and back["n"] == 3


def test_step_management(tmp_path, mesh8):
    root = tmp_path / "run"
    assert latest_step(root) is None and checkpoint_steps(root) == []
    states = {step: _train_state(mesh8, seed=step) for step in (1, 2, 3)}
    for step, state in states.items():
        assert save_checkpoint(root, state, step=step) == root / str(step)
    assert checkpoint_steps(root) == [1, 2, 3] and latest_step(root) == 3
    assert jaxpar.latest_step(root) == 3 and jaxpar.checkpoint_steps(root) == [1, 2, 3]
    _assert_identical(restore_checkpoint(root, states[1], step=2), states[2])
    _assert_identical(restore_checkpoint(root, states[1]), states[3])
    (root / "4").mkdir()  # left empty (a run stopped as it began saving): no step
    assert checkpoint_steps(root) == [1, 2, 3] and latest_step(root) == 3
    _assert_identical(restore_checkpoint(root, states[1]), states[3])


def test_a_damaged_checkpoint_is_named(tmp_path):
    state = {"w": np.arange(8.0), "b": np.ones(3)}
    root = tmp_path / "run"
    save_checkpoint(root, state, step=1)
    save_checkpoint(root, state, step=2)
    (root / "2" / "_METADATA").write_text("{\"tr")  # cut short
    with pytest.raises(ValueError, match=r"checkpoint at .*run/2 is damaged: _METADATA has 4 "
                                         r"bytes"):
        restore_checkpoint(root, state)
    (root / "2" / CHECKSUMS).unlink()  # saved without checksums: orbax's metadata still named
    with pytest.raises(ValueError, match=r"checkpoint at .*run/2 is damaged: its metadata "
                                         r"cannot be read \(JSONDecodeError"):
        restore_checkpoint(root, state)
    _assert_identical(restore_checkpoint(root, state, step=1), state)
    save_checkpoint(root, state, step=2, overwrite=True)  # replaced like any checkpoint
    _assert_identical(restore_checkpoint(root, state), state)


def _files(directory: Path) -> dict[str, int]:
    """Every file under `directory` by relative path, with its size."""
    return {path.relative_to(directory).as_posix(): path.stat().st_size
            for path in directory.rglob("*") if path.is_file()}


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_an_untouched_checkpoint_has_every_file_checksummed(tmp_path, mesh8):
    state = _train_state(mesh8)
    directory = save_checkpoint(tmp_path / "run", state, step=5)
    record = json.loads((directory / CHECKSUMS).read_text())["files"]
    files = _files(directory)
    assert set(record) == set(files) - {CHECKSUMS} and len(record) > 5
    assert all(record[name]["size"] == size for name, size in files.items() if name in record)
    _assert_identical(restore_checkpoint(tmp_path / "run", state), state)
    assert checkpoint_steps(tmp_path / "run") == [5] and latest_step(tmp_path / "run") == 5


def test_a_flipped_byte_in_a_data_file_is_named(tmp_path):
    # Flipping this byte restored silently with a wrong value in "w".
    state = {"w": np.arange(4096.0), "b": np.ones(3)}
    root = tmp_path / "run"
    save_checkpoint(root, state, step=1)
    directory = save_checkpoint(root, state, step=2)
    files = _files(directory)
    data_file = max(files, key=files.get)  # the one holding "w"
    assert "/d/" in f"/{data_file}"
    _flip_a_byte(directory / data_file)
    with pytest.raises(ValueError, match=re.escape(f"checkpoint at {directory} is damaged: "
                                                   f"{data_file} has crc32 ")
                       + r".*The file was changed after the checkpoint was saved.*restore an "
                         "earlier step"):
        restore_checkpoint(root, state)
    _assert_identical(restore_checkpoint(root, state, step=1), state)


@pytest.mark.usefixtures("no_orbax_restore")
def test_truncated_and_missing_files_are_named_before_orbax_reads_them(tmp_path):
    directory = save_checkpoint(tmp_path / "ckpt", {"w": np.arange(4096.0), "b": np.ones(3)})
    files = _files(directory)
    data_file = max(files, key=files.get)
    with (directory / data_file).open("r+b") as f:
        f.truncate(100)
    (directory / "_METADATA").unlink()
    with pytest.raises(ValueError, match=re.escape(f"checkpoint at {directory} is damaged: ")
                       + ".*These 2 files were changed") as caught:
        restore_checkpoint(tmp_path / "ckpt", {"w": np.zeros(4096), "b": np.zeros(3)})
    assert f"{data_file} has 100 bytes, {files[data_file]} when saved" in str(caught.value)
    assert "_METADATA is missing" in str(caught.value)


def test_a_step_that_lost_orbax_metadata_is_still_a_step_and_named(tmp_path):
    # Without its _CHECKPOINT_METADATA the step was skipped: resuming went back a step, silently.
    state = {"w": np.arange(8.0)}
    save_checkpoint(tmp_path / "run", state, step=1)
    (save_checkpoint(tmp_path / "run", state, step=2) / "_CHECKPOINT_METADATA").unlink()
    assert latest_step(tmp_path / "run") == 2
    with pytest.raises(ValueError, match=re.escape("run/2 is damaged: _CHECKPOINT_METADATA is "
                                                   "missing. The file was changed")):
        restore_checkpoint(tmp_path / "run", state)


@pytest.mark.usefixtures("no_orbax_restore")
def test_a_damaged_checksum_record_is_named(tmp_path):
    directory = save_checkpoint(tmp_path / "ckpt", {"w": np.arange(64.0)})
    _flip_a_byte(directory / CHECKSUMS)
    with pytest.raises(ValueError, match=re.escape(f"checkpoint at {directory} is damaged: its "
                                                   f"checksum record {CHECKSUMS} was changed")):
        restore_checkpoint(tmp_path / "ckpt", {"w": np.zeros(64)})


def test_a_checkpoint_without_checksums_still_restores(tmp_path, mesh8, caplog):
    # As one saved before checksums were recorded.
    state = _train_state(mesh8)
    for step in (1, 2):
        (save_checkpoint(tmp_path / "run", state, step=step) / CHECKSUMS).unlink()
    assert checkpoint_steps(tmp_path / "run") == [1, 2] and latest_step(tmp_path / "run") == 2
    with caplog.at_level(logging.DEBUG, logger="jaxpar.train.checkpoint"):
        _assert_identical(restore_checkpoint(tmp_path / "run", state), state)
    assert [r.message.endswith("restored unverified.") for r in caplog.records] == [True]
    (save_checkpoint(tmp_path / "flat", state) / CHECKSUMS).unlink()
    _assert_identical(restore_checkpoint(tmp_path / "flat", state), state)


def test_refuses_to_overwrite_unless_asked(tmp_path, mesh8):
    first, second = _train_state(mesh8, seed=1), _train_state(mesh8, seed=2)
    save_checkpoint(tmp_path / "ckpt", first)
    with pytest.raises(ValueError, match="already exists.*overwrite=True"):
        save_checkpoint(tmp_path / "ckpt", second)
    save_checkpoint(tmp_path / "ckpt", second, overwrite=True)
    _assert_identical(restore_checkpoint(tmp_path / "ckpt", first), second)
    save_checkpoint(tmp_path / "run", first, step=4)
    with pytest.raises(ValueError, match="overwrite=True"):
        save_checkpoint(tmp_path / "run", second, step=4)


def test_never_writes_over_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds no checkpoint"):
        save_checkpoint(tmp_path, {"x": np.ones(2)}, overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_path_that_cannot_be_made_is_refused_before_orbax_starts(tmp_path):
    """Under a file, orbax raised about its own temporary directory and its threads then held
    the process for five minutes at exit."""
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(ValueError, match=r"cannot make .*afile/ck/3: .*afile is a file"):
        save_checkpoint(tmp_path / "afile" / "ck", {"x": np.ones(2)}, step=3)
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.parametrize("leaf, error, said", [
    (np.array(["a", "b"]), TypeError, r"state\['bad'\] is a numpy ndarray of dtype <U1"),
    # (numpy's long double is a float64 on some platforms: no wider float to refuse there)
    *([(np.array([1.0], dtype=np.longdouble), TypeError, "of dtype float128")]
      if np.dtype(np.longdouble).itemsize > 8 else []),
    (np.array(["2020-01-01"], dtype="datetime64[D]"), TypeError, "datetime64"),
    (np.zeros(2, dtype=[("a", "f4")]), TypeError, "dtype .*'a'"),
    (2 ** 70, ValueError, r"state\['bad'\] is the int 1180591620717411303424, outside 64 bits")])
def test_leaves_the_format_cannot_hold_are_named_before_anything_is_written(tmp_path, leaf,
                                                                            error, said):
    """tensorstore refused them mid-save naming no leaf ('Unsupported data type: "str32"'),
    and left a temporary directory behind."""
    with pytest.raises(error, match=said):
        save_checkpoint(tmp_path / "ck", {"w": np.ones(2), "bad": leaf}, step=1)
    assert not (tmp_path / "ck").exists()


def test_relative_paths_resolve_to_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    saved = save_checkpoint("ckpt", {"x": np.arange(3)}, step=7)
    assert saved.is_absolute() and saved == tmp_path / "ckpt" / "7"
    assert latest_step("ckpt") == 7


@pytest.mark.usefixtures("no_orbax_restore")
def test_missing_checkpoints_raise_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nowhere"))):
        restore_checkpoint(tmp_path / "nowhere", {"x": np.ones(2)})
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        restore_checkpoint(tmp_path, {"x": np.ones(2)})
    save_checkpoint(tmp_path / "run", {"x": np.ones(2)}, step=1)
    with pytest.raises(FileNotFoundError, match=re.escape("no step 5") + r".*\[1\]"):
        restore_checkpoint(tmp_path / "run", {"x": np.ones(2)}, step=5)


@pytest.mark.usefixtures("no_orbax_restore")
def test_structure_mismatch_names_the_leaf(tmp_path):
    save_checkpoint(tmp_path / "ckpt", {"params": {"w": jnp.ones((16, 32))}, "step": 3})
    extra = {"params": {"w": jnp.ones((16, 32)), "v": jnp.ones(4)}, "step": 0}
    with pytest.raises(ValueError, match=re.escape("target['params']['v'] (shape (4,)) is not")):
        restore_checkpoint(tmp_path / "ckpt", extra)
    with pytest.raises(ValueError, match=re.escape("['step'] (shape ()) but target has no")):
        restore_checkpoint(tmp_path / "ckpt", {"params": {"w": jnp.ones((16, 32))}})


@pytest.mark.usefixtures("no_orbax_restore")
def test_empty_entries_are_structure_and_named(tmp_path):
    # A target lacking a saved None entry (or holding one the checkpoint lacks) was read by
    # orbax and reported as "data files may be missing or damaged".
    save_checkpoint(tmp_path / "ckpt", {"w": jnp.ones(4), "ema": None})
    with pytest.raises(ValueError, match=r"the checkpoint holds an empty entry at ema \(None, "
                                         r"or a container of no arrays\) where the other"):
        restore_checkpoint(tmp_path / "ckpt", {"w": jnp.ones(4)})
    save_checkpoint(tmp_path / "plain", {"w": jnp.ones(4)})
    with pytest.raises(ValueError, match=r"target has an empty entry at ema \(None"):
        restore_checkpoint(tmp_path / "plain", {"w": jnp.ones(4), "ema": None})


@pytest.mark.usefixtures("no_orbax_restore")
def test_a_missing_subtree_is_named_by_its_arrays_not_an_empty_entry_inside_it(tmp_path):
    # Adam's state saved beside the parameters, restored into the parameters alone: the
    # error named optax's EmptyState at o/1 ("the checkpoint holds an empty entry"), not the
    # moments the target lacks.
    import optax

    params = {"w": jnp.ones((4, 2))}
    save_checkpoint(tmp_path / "ckpt", {"p": params,
                                        "o": optax.chain(optax.adam(1e-3)).init(params)})
    with pytest.raises(ValueError, match=r"holds \['o'\].*but target has no such leaf"):
        restore_checkpoint(tmp_path / "ckpt", {"p": params})


def test_a_tuple_restored_into_a_dict_is_named_a_structure_mismatch(tmp_path):
    save_checkpoint(tmp_path / "ckpt", {"t": (jnp.ones(2), jnp.zeros(2))})
    with pytest.raises(ValueError, match=r"target's containers differ .*a tuple or list was "
                                         r"saved where target has a dict"):
        restore_checkpoint(tmp_path / "ckpt", {"t": {"0": jnp.ones(2), "1": jnp.ones(2)}})


@pytest.mark.usefixtures("no_orbax_restore")
def test_a_python_scalar_target_of_another_kind_is_refused(tmp_path):
    # orbax cast to the target's type: a learning rate of 0.25 came back 0, a step 3 True.
    save_checkpoint(tmp_path / "ckpt", {"lr": 0.25, "step": 3, "ema": np.float32(2.5)})
    for target, said in (({"lr": 0, "step": 0, "ema": 0.0}, r"target\['lr'\] is a Python int "
                          r"but the checkpoint holds a float \(float64\)"),
                         ({"lr": 0.0, "step": False, "ema": 0.0}, r"target\['step'\] is a "
                          r"Python bool but the checkpoint holds a int"),
                         ({"lr": 0.0, "step": 0, "ema": 0}, r"target\['ema'\] is a Python int "
                          r"but the checkpoint holds a float \(float32\)")):
        with pytest.raises(ValueError, match=said):
            restore_checkpoint(tmp_path / "ckpt", target)


def test_a_python_scalar_target_of_the_saved_kind_restores(tmp_path):
    save_checkpoint(tmp_path / "ckpt", {"lr": 0.25, "step": 3, "on": True})
    got = restore_checkpoint(tmp_path / "ckpt", {"lr": 0.0, "step": 0, "on": False})
    assert got == {"lr": 0.25, "step": 3, "on": True}


@pytest.mark.usefixtures("no_orbax_restore")
def test_shape_and_dtype_mismatches_name_the_leaf_and_both_shapes(tmp_path):
    save_checkpoint(tmp_path / "ckpt", {"params": {"w": jnp.ones((16, 32))}})
    wrong_shape = {"params": {"w": jax.ShapeDtypeStruct((32, 16), jnp.float32)}}
    with pytest.raises(ValueError, match=re.escape("['params']['w'] has shape (32, 16)")
                       + r".*\(16, 32\)"):
        restore_checkpoint(tmp_path / "ckpt", wrong_shape)
    wrong_dtype = {"params": {"w": jax.ShapeDtypeStruct((16, 32), jnp.bfloat16)}}
    with pytest.raises(ValueError, match=re.escape("['params']['w'] has dtype bfloat16")
                       + ".*float32"):
        restore_checkpoint(tmp_path / "ckpt", wrong_dtype)


@pytest.mark.usefixtures("no_orbax_restore")
def test_shardings_that_do_not_fit_name_the_leaf(tmp_path, mesh4):
    save_checkpoint(tmp_path / "ckpt", {"w": jnp.ones((16, 30))})
    target = {"w": jax.ShapeDtypeStruct((16, 30), jnp.float32)}
    four_ways = NamedSharding(mesh4, P(None, ("dp", "tp")))
    with pytest.raises(ValueError, match=re.escape("target['w'] (shape (16, 30)) does not divide")):
        restore_checkpoint(tmp_path / "ckpt", target, shardings=four_ways)
    with pytest.raises(ValueError, match=re.escape("target['w'] has spec P(None, None, 'dp'), "
                                                   "too long for its shape (16, 30)")):
        restore_checkpoint(tmp_path / "ckpt", target, mesh=mesh4, shardings=P(None, None, "dp"))
    with pytest.raises(ValueError, match="shardings must be one Sharding or a pytree"):
        restore_checkpoint(tmp_path / "ckpt", target, shardings={"v": NamedSharding(mesh4, P())})
    with pytest.raises(TypeError, match=re.escape("shardings['w']='tp'")):
        restore_checkpoint(tmp_path / "ckpt", target, shardings={"w": "tp"})
    with pytest.raises(ValueError, match=re.escape("shardings['w']=P('zz',) names "
                                                   "axes ['zz'] that mesh= lacks")):
        restore_checkpoint(tmp_path / "ckpt", target, mesh=mesh4, shardings={"w": P("zz")})


def test_unsaveable_state_is_rejected_before_writing(tmp_path):
    with pytest.raises(TypeError, match=re.escape("state['name'] is a str")):
        save_checkpoint(tmp_path / "ckpt", {"name": "gpt", "x": np.ones(2)})
    with pytest.raises(ValueError, match="holds no arrays"):
        save_checkpoint(tmp_path / "ckpt", {})
    with pytest.raises(ValueError, match="step=-1"):
        save_checkpoint(tmp_path / "ckpt", {"x": np.ones(2)}, step=-1)
    with pytest.raises(ValueError, match=re.escape("state['e'] has no elements (shape (0, 4))")):
        save_checkpoint(tmp_path / "ckpt", {"e": np.ones((0, 4)), "x": np.ones(2)})
    donated = jax.jit(lambda a: a + 1, donate_argnums=0)
    gone = jnp.ones(4)
    donated(gone)
    with pytest.raises(ValueError, match=re.escape("state['x'] was deleted (a donated buffer")):
        save_checkpoint(tmp_path / "ckpt", {"x": gone})
    assert not (tmp_path / "ckpt").exists()


def test_a_process_local_array_in_a_multi_process_save_is_named(tmp_path, monkeypatch):
    # Across processes orbax refused it deep inside ("Cannot serialize host local jax.Array")
    # and left a temporary directory behind.
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    told = []  # what this process tells the other (simulated: it refused nothing)
    monkeypatch.setattr(ckpt, "gather_rows",
                        lambda row: told.append(row.tolist()) or np.stack([row, [0, 0]]))
    with pytest.raises(ValueError, match=re.escape("state['count'] lives on this process's "
                                                   "devices only")):
        save_checkpoint(tmp_path / "ckpt", {"count": jnp.zeros((), jnp.int32)})
    assert not (tmp_path / "ckpt").exists()
    assert told == [[1, 0]]  # the other process is told, and refuses too


def test_64_bit_values_are_not_restored_onto_devices_as_32_bit(tmp_path, mesh8):
    # With x64 off, 1e300 came back as float32 inf and 2**40 + 1 as int32 1, with no error.
    state = {"f": np.array([1 + 2**-40, 1e300]), "i": np.array([2**40 + 1], np.int64)}
    save_checkpoint(tmp_path / "ckpt", state)
    target = {"f": np.zeros(2), "i": np.zeros(1, np.int64)}
    with pytest.raises(ValueError, match=r"target\['f'\] is float64 .*holds as float32 unless "
                                         "64-bit mode is on"):
        restore_checkpoint(tmp_path / "ckpt", target, mesh=mesh8)
    back = restore_checkpoint(tmp_path / "ckpt", target)  # numpy, on the host: exact
    np.testing.assert_array_equal(back["f"], state["f"])
    np.testing.assert_array_equal(back["i"], state["i"])


def _loss(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _train_step(state, x, y):
    opt = optax.adamw(1e-2)
    loss, grads = jax.value_and_grad(_loss)(state["params"], x, y)
    updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss


def _run(step_fn, state, x, y, steps: int):
    losses = []
    for _ in range(steps):
        state, loss = step_fn(state, x, y)
        losses.append(float(loss))
    return state, losses


def _sharded_step(state, mesh: Mesh, specs: dict[int, P], batch_spec: P):
    state_shardings = _by_rank(state, mesh, specs)
    batch = NamedSharding(mesh, batch_spec)
    return jax.jit(_train_step, in_shardings=(state_shardings, batch, batch),
                   out_shardings=(state_shardings, NamedSharding(mesh, P())))


def test_training_continues_with_the_same_loss(tmp_path, mesh8, mesh4):
    kx, kw = jax.random.split(jax.random.key(42))
    x = jax.random.normal(kx, (32, 16))
    y = x @ jax.random.normal(kw, (16, 8))
    params = {"w": jnp.zeros((16, 8)), "b": jnp.zeros(8)}
    state = {"params": params, "opt_state": optax.adamw(1e-2).init(params)}
    _, reference = _run(jax.jit(_train_step), jax.device_put(state, jax.devices()[0]), x, y, 6)

    specs8 = {0: P(), 1: P("model"), 2: P(None, "model")}
    step8 = _sharded_step(state, mesh8, specs8, P("data", None))
    state8, first = _run(step8, jax.device_put(state, _by_rank(state, mesh8, specs8)), x, y, 3)
    save_checkpoint(tmp_path / "run", state8, step=3)

    specs4 = {0: P(), 1: P("dp"), 2: P("dp", "tp")}
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    shardings4 = _by_rank(state, mesh4, specs4)
    resumed = restore_checkpoint(tmp_path / "run", abstract, shardings=shardings4)
    assert resumed["params"]["w"].sharding == NamedSharding(mesh4, P("dp", "tp"))
    step4 = _sharded_step(state, mesh4, specs4, P("dp", None))
    _, second = _run(step4, resumed, x, y, 3)
    np.testing.assert_allclose(first + second, reference, rtol=1e-5)
    assert reference[-1] < reference[0]


def test_processes_verify_shares_of_the_files_that_cover_them_once():
    # Before, every process read every file of a multi-process checkpoint again.
    from jaxpar.train.checkpoint import _share

    saved = {f"f{i}": {"size": size, "crc32": 0} for i, size in enumerate([900, 500, 400, 1, 0])}
    assert _share(saved, 0, 1) == list(saved)
    shares = [_share(saved, p, 2) for p in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(saved)  # every file, once
    assert sorted(sum(saved[n]["size"] for n in share) for share in shares) == [900, 901]


def test_a_failed_read_of_verified_files_points_at_the_placement(tmp_path, monkeypatch):
    """Every orbax failure was reported as data files "missing or damaged", also after the
    files had matched their checksums (a restore onto devices another process owns)."""
    save_checkpoint(tmp_path / "ckpt", {"w": jnp.ones(4)})

    def refuse(self, *args, **kwargs):
        raise ValueError("If the Array has no addressable shards, dtype must be provided")

    monkeypatch.setattr(ocp.StandardCheckpointer, "restore", refuse)
    with pytest.raises(ValueError, match=r"cannot be read \(ValueError: If the Array has no "
                       r"addressable shards.*match the checksums saved with them, so look at "
                       r"where the target places them"):
        restore_checkpoint(tmp_path / "ckpt", {"w": jnp.ones(4)})
    (tmp_path / "ckpt" / "_CHECKSUMS.json").unlink()  # saved before jaxpar kept checksums
    with pytest.raises(ValueError, match="its data files may be missing or damaged"):
        restore_checkpoint(tmp_path / "ckpt", {"w": jnp.ones(4)})
