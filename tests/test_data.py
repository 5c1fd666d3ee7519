"""shard_batch / parse_dataset_strategy: placements per dataset strategy, MindSpore's errors, and
the process-local -> global shape arithmetic used with several processes."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.train.data import global_shape, parse_dataset_strategy, process_slabs, shard_batch

ALL = ("d0", "d1", "d2")


def batch():
    return (np.arange(16 * 4, dtype=np.float32).reshape(16, 4),
            np.arange(16, dtype=np.int32))


@pytest.fixture(scope="module")
def mesh():
    return jaxpar.make_mesh(8)


@pytest.mark.parametrize("strategy, specs", [
    ("data_parallel", (P(ALL), P(ALL))),
    ("full_batch", (P(), P())),
    (((8, 1), (8,)), (P(ALL), P(ALL))),
    (((2, 4), (1,)), (P("d0", ("d1", "d2")), P())),
    ([[2, 4], [1]], (P("d0", ("d1", "d2")), P())),  # lists, as a YAML config gives them
    (([8, 1], (8,)), (P(ALL), P(ALL))),
    (((4, 1), P("d2")), (P(("d0", "d1")), P("d2"))),
    ((jaxpar.Layout((2, 4), ("dp", "mp"))("dp", "mp"), (2,)),
     (P("d0", ("d1", "d2")), P("d0"))),
])
def test_shard_batch_places_each_strategy(strategy, specs, mesh):
    out = shard_batch(batch(), mesh, strategy)
    for arr, want, ref in zip(out, specs, batch(), strict=True):
        assert isinstance(arr, jax.Array) and isinstance(arr.sharding, NamedSharding)
        assert arr.sharding.spec == want
        assert arr.sharding.mesh == mesh
        np.testing.assert_array_equal(np.asarray(arr), ref)
    assert parse_dataset_strategy(strategy, batch(), mesh) == specs


def test_data_parallel_gives_each_device_its_rows(mesh):
    x = shard_batch(jnp.arange(16.0).reshape(16, 1), mesh)
    pieces = sorted(float(s.data[0, 0]) for s in x.addressable_shards)
    assert pieces == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]
    assert {s.data.shape for s in x.addressable_shards} == {(2, 1)}


def test_default_mesh_and_pytree_batch():
    out = shard_batch({"x": batch()[0], "y": batch()[1]})
    assert out["x"].sharding.spec == P(ALL) and out["y"].sharding.spec == P(ALL)
    assert len(out["x"].sharding.mesh.devices.flat) == len(jax.devices())


def test_by_default_the_context_dataset_strategy_places_the_batch(mesh):
    # The README had said so, and shard_batch placed the rows data parallel whatever was set.
    jaxpar.set_auto_parallel_context(dataset_strategy="full_batch")
    try:
        x, y = shard_batch(batch(), mesh)
        assert x.sharding.spec == P() and y.sharding.spec == P()
        x, _ = shard_batch(batch(), mesh, "data_parallel")  # given: it wins
        assert x.sharding.spec == P(ALL)
    finally:
        jaxpar.reset_auto_parallel_context()
    assert shard_batch(batch(), mesh)[0].sharding.spec == P(ALL)


def test_named_mesh_data_parallel_uses_every_axis():
    mesh = jaxpar.make_mesh((4, 2), ("dp", "tp"))
    (x,) = shard_batch((batch()[0],), mesh)
    assert x.sharding.spec == P(("dp", "tp"))


def test_parse_accepts_shape_dtype_structs(mesh):
    spec = parse_dataset_strategy(((1, 8),), (jax.ShapeDtypeStruct((3, 64), jnp.float32),), mesh)
    assert spec == (P(None, ALL),)


@pytest.mark.parametrize("strategy, exc, match", [
    (["data_parallel", "full_batch"], TypeError,
     r"dataset_strategy\[0\]='data_parallel' for input 0 .* each entry must be a tuple"),
    ({"x": (8, 1)}, TypeError, r"dataset_strategy=\{'x': \(8, 1\)\} must be a str"),
    (8, TypeError, "dataset_strategy=8 must be a str"),
    ("model_parallel", ValueError, "dataset_strategy='model_parallel' must be one of"),
    ((), ValueError, r"dataset_strategy=\(\) is empty; .* e.g. \(\(8, 1\), \(8,\)\)"),
    (((8, 1),), ValueError, "has 1 entries but the batch has 2 inputs"),
    (([8, "1"], (8,)), TypeError, r"dataset_strategy\[0\]=\(8, '1'\) for input 0 of shape "
                                  r"\(16, 4\): count '1' is a str"),
    (((8, 1.0), (8,)), TypeError, r"dataset_strategy\[0\].*count 1.0 is a float, not an int"),
    (((8, True), (8,)), TypeError, "count True is a bool"),
    (((8,), (8,)), ValueError, r"dataset_strategy\[0\].* rank 2 needs 2 counts, got 1"),
    (((8, 0), (8,)), ValueError, "count 0 for dim 1 is not positive"),
    (((8, -2), (8,)), ValueError, "count -2 for dim 1 is not positive"),
    (((8, 1), (3,)), ValueError, r"dataset_strategy\[1\].* count 3 does not divide dim 0 of "
                                 "size 16"),
    (((8, 4), (8,)), ValueError, "multiply to 32, more than the 8 devices"),
    (((8, 1), (16,)), ValueError, r"dataset_strategy\[1\].*multiply to 16"),
    (((4, 2), P("d3")), ValueError, r"dataset_strategy\[1\].*axis 'd3' is not in the mesh"),
])
def test_dataset_strategy_errors(strategy, exc, match, mesh):
    with pytest.raises(exc, match=match):
        shard_batch(batch(), mesh, strategy)


def test_data_parallel_errors(mesh):
    with pytest.raises(ValueError, match="input 0 is a scalar"):
        shard_batch((np.float32(1.0),), mesh, "data_parallel")
    with pytest.raises(ValueError, match="input 0 is a scalar"):
        parse_dataset_strategy("data_parallel", (np.float32(1.0),), mesh)


def test_several_processes_refuse_a_batch_the_devices_do_not_divide(mesh, monkeypatch):
    # each process holds an equal slice of the global batch: 12 rows cannot split over 8
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"input 0 of shape \(12, 4\) has a batch dim of 12, "
                                         "which does not divide over the 8 devices"):
        parse_dataset_strategy("data_parallel", (np.ones((12, 4)),), mesh)


def test_parse_dataset_strategy_gives_the_specs_shard_batch_places_in(mesh):
    # A batch of 12 on 8 devices: shard_batch (and AutoParallel) cut it 4 ways with a warning,
    # parse_dataset_strategy, which says what shard_batch does, refused it.
    for rows in (16, 12):
        batch = (np.ones((rows, 4)), np.ones(rows))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            placed = [x.sharding.spec for x in shard_batch(batch, mesh, "data_parallel")]
        with pytest.warns(UserWarning, match="cut 4 ways") if rows == 12 else \
                warnings.catch_warnings():
            said = parse_dataset_strategy("data_parallel", batch, mesh)
        assert list(said) == placed
    assert said == (P(("d0", "d1")), P(("d0", "d1")))


def test_a_partial_last_batch_is_placed_as_autoparallel_places_it(mesh):
    # An epoch's last batch of 12 on 8 devices: AutoParallel cut it 4 ways with a warning,
    # shard_batch refused it, so a loader placing batches with it stopped there.
    with pytest.warns(UserWarning, match=r"batch of 12 does not divide into 8 devices; it is "
                                         r"cut 4 ways, over d0 x d1") as caught:
        x, y = shard_batch((np.arange(48.0).reshape(12, 4), np.ones(12)), mesh)
    assert len(caught) == 1  # one warning per call, not one per leaf of the batch
    assert x.sharding.spec == P(("d0", "d1")) and y.sharding.spec == P(("d0", "d1"))
    np.testing.assert_array_equal(np.asarray(x), np.arange(48.0).reshape(12, 4))


def test_an_axis_of_size_one_does_not_count_as_a_cut():
    # On a (1, 8) mesh a batch of 4 was "cut 1 ways, over a, and each piece is computed on 8
    # devices" (spec P('a')): no axis cuts it, and the warning now says so.
    mesh = jaxpar.make_mesh((1, 8), ("a", "b"))
    with pytest.warns(UserWarning, match=r"batch of 4 does not divide into 8 devices; no mesh "
                                         r"axis divides it, so every device computes"):
        x = shard_batch(np.ones((4, 3), np.float32), mesh)
    assert x.sharding.spec == P()


def test_count_the_mesh_cannot_make():
    mesh = jaxpar.make_mesh(6)  # axes of sizes 3 and 2: no set of axes makes 4
    with pytest.raises(ValueError, match=r"dataset_strategy\[0\]=\(1, 4, 1\) for input 0 of "
                                         r"shape \(2, 4, 2\): the entry.*not a product of mesh"):
        shard_batch((np.ones((2, 4, 2)),), mesh, ((1, 4, 1),))


def test_bad_mesh_and_leaf():
    with pytest.raises(TypeError, match="mesh=8 must be a jax.sharding.Mesh"):
        shard_batch(batch(), 8)
    with pytest.raises(TypeError, match="input 0 is a str, not an array"):
        shard_batch(("abc",), jaxpar.make_mesh(8), "full_batch")
    # An array JAX cannot hold: named here, as shard() names it (was JAX's own TypeError).
    with pytest.raises(TypeError, match="input 1 is a numpy array of dtype object, which JAX "
                                        "cannot hold; convert it"):
        shard_batch((np.ones(8), np.array([1, "a"] * 4, dtype=object)), jaxpar.make_mesh(8))


# ---------------------------------------------------------------------------------------------
# Several processes: shape arithmetic on made-up process layouts


TWO_PROCS = np.array([0, 0, 0, 0, 1, 1, 1, 1]).reshape(2, 2, 2)   # process = the d0 coordinate
FOUR_PROCS = np.array([0, 1, 0, 1, 2, 3, 2, 3]).reshape(2, 2, 2)  # process = (d0, d2)


@pytest.mark.parametrize("grid, spec, process, slabs", [
    (TWO_PROCS, P(ALL, None), 0, (2, 1)),               # data_parallel: half the rows each
    (TWO_PROCS, P(ALL, None), 1, (2, 1)),
    (TWO_PROCS, P(), 0, ()),                            # full_batch: every process has it all
    (TWO_PROCS, P(None, ("d1", "d2")), 1, (1, 1)),      # cut only inside a process
    (TWO_PROCS, P("d1", "d0"), 0, (1, 2)),
    (FOUR_PROCS, P(ALL), 3, (4,)),
    (FOUR_PROCS, P("d1", "d2"), 2, (1, 2)),
    (np.zeros((2, 2, 2), int), P(ALL), 0, (1,)),        # one process
])
def test_process_slabs(grid, spec, process, slabs):
    assert process_slabs(grid, ALL, spec, process) == slabs


def test_global_shape():
    assert global_shape((4, 16), (2,)) == (8, 16)
    assert global_shape((4, 16), (2, 1)) == (8, 16)
    assert global_shape((4, 16), ()) == (4, 16)
    assert global_shape((2, 3, 5), (4, 1, 2)) == (8, 3, 10)


def test_process_slabs_rejects_uneven_layouts():
    grid = np.array([0, 0, 0, 1, 1, 1, 1, 1]).reshape(2, 2, 2)
    with pytest.raises(ValueError, match="process 0 holds 3 of the 8 pieces"):
        process_slabs(grid, ALL, P(ALL), 0)
