"""make_mesh and make_hybrid_mesh: axes, device order across processes, device kinds, errors."""

import re
from dataclasses import dataclass

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from jaxpar.mesh import (
    available_platforms,
    hybrid_grid,
    make_hybrid_mesh,
    make_mesh,
    mesh_devices,
    prime_factors,
)


def test_device_count_factors_into_prime_axes():
    mesh = make_mesh(8)
    assert mesh.axis_names == ("d0", "d1", "d2")
    assert tuple(mesh.shape.values()) == (2, 2, 2)
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert prime_factors(12) == [3, 2, 2] and prime_factors(7) == [7] and prime_factors(1) == []


def test_explicit_shape_and_names():
    mesh = make_mesh((4, 2), ("dp", "tp"))
    assert dict(mesh.shape) == {"dp": 4, "tp": 2}
    assert make_mesh(1).devices.size == 1
    # numpy counts, as strategies and Layout take them (both were refused as not ints)
    assert dict(make_mesh(np.int64(8)).shape) == {"d0": 2, "d1": 2, "d2": 2}
    assert dict(make_mesh((np.int64(4), 2)).shape) == {"d0": 4, "d1": 2}


@pytest.mark.parametrize("names, shape", [(("x",), (8,)), (("dp", "tp"), (4, 2))])
def test_too_few_axis_names_for_a_device_count_show_the_call_with_a_shape(names, shape):
    with pytest.raises(ValueError, match=re.escape(f"give the shape too: make_mesh({shape}, "
                                                   f"{names}).")):
        make_mesh(8, names)
    assert tuple(make_mesh(shape, names).shape.values()) == shape  # the call shown works


def test_devices_fill_the_mesh_by_process_then_id():
    devices = mesh_devices()
    assert [(d.process_index, d.id) for d in devices] == \
        sorted((d.process_index, d.id) for d in jax.devices())
    assert [d.id for d in make_mesh((2, 4)).devices.flat] == [d.id for d in devices]


def test_platform_selection():
    assert make_mesh(2, device="CPU").devices.flat[0].platform == "cpu"
    assert available_platforms() == ["CPU"]  # conftest: JAX_PLATFORMS=cpu


@pytest.mark.parametrize("kind", ["TPU", "GPU"])
def test_absent_platform_names_the_available_ones(kind):
    if kind in available_platforms():
        pytest.skip(f"a {kind} is present, so the missing-platform path cannot be exercised")
    here = re.escape(str(available_platforms()))  # ['CPU'] under conftest's JAX_PLATFORMS
    with pytest.raises(ValueError, match=rf"no {kind} devices.*available platforms: {here}"):
        make_mesh(2, device=kind)
    with pytest.raises(ValueError, match=f"no {kind} devices"):
        make_hybrid_mesh((1, 2), (2, 1), device=kind)


@pytest.mark.parametrize("args,kwargs,exc,match", [
    ((16,), {}, ValueError, "xla_force_host_platform_device_count=16"),
    ((0,), {}, ValueError, "positive device count"),
    (("8",), {}, TypeError, "device count"),
    (((4, 0),), {}, ValueError, "positive ints"),
    (((4, 2), ("dp",)), {}, ValueError, "name each of the 2"),
    (((4, 2), ("dp", "dp")), {}, ValueError, "distinct"),
    ((8,), {"device": "Ascend"}, ValueError, "CPU"),
])
def test_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        make_mesh(*args, **kwargs)


@pytest.mark.parametrize("names", [(n for n in ("dp", "tp")), {"dp", "tp"}, "dp"])
def test_axis_names_must_be_a_tuple_or_list(names):
    # A set's order varies between runs (so would the axes'); a generator has no length.
    with pytest.raises(TypeError, match=r"make_mesh axis_names=.* must be a tuple or list of "
                                        r"strings, one per mesh axis, e.g. \('d0', 'd1'\)"):
        make_mesh((4, 2), names)
    assert make_mesh((4, 2), ["dp", "tp"]).axis_names == ("dp", "tp")


def test_hybrid_mesh_axis_name_errors_name_make_hybrid_mesh():
    with pytest.raises(ValueError, match=r"^make_hybrid_mesh axis_names=\('node',\) must name "
                                         r"each of the 2 mesh axes"):
        make_hybrid_mesh((1, 4), (2, 1), ("node",))
    with pytest.raises(TypeError, match=r"^make_hybrid_mesh axis_names=\{'node'\}"):
        make_hybrid_mesh((4,), (2,), {"node"})


def test_hybrid_mesh_puts_granules_on_the_outer_axis():
    mesh = make_hybrid_mesh((1, 4), (2, 1), ("node", "gpu"))
    assert dict(mesh.shape) == {"node": 2, "gpu": 4}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert ids.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a simulated node per row


def test_hybrid_axis_may_hold_both_parts():
    # Axis 0 = 2 granules x 2 devices: still four consecutive devices per granule.
    mesh = make_hybrid_mesh((2, 2), (2, 1))
    assert dict(mesh.shape) == {"d0": 4, "d1": 2}
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert ids.flatten().tolist() == list(range(8))
    assert make_hybrid_mesh((1, 2), (2, 1)).devices.size == 4  # fewer devices: the first ones


@pytest.mark.parametrize("ici,dcn,exc,match", [
    ((1, 4), (2,), ValueError, "one entry per mesh axis"),
    (4, (2,), TypeError, "tuple of axis sizes"),
    ((1, 0), (2, 1), ValueError, "positive ints"),
    ((4, 1), (1, 2), ValueError, "axes that cross granules first"),
    ((2, 4), (2, 1), ValueError, "asked for 16 devices"),
])
def test_hybrid_errors(ici, dcn, exc, match):
    with pytest.raises(exc, match=match):
        make_hybrid_mesh(ici, dcn)


@dataclass(frozen=True)
class FakeDevice:
    """Stands in for the devices of a multi-process run (what create_hybrid_device_mesh reads)."""

    id: int
    process_index: int
    platform: str = "cpu"
    device_kind: str = "cpu"


TWO_PROCESSES = [FakeDevice(p * 100 + i, p) for p in (0, 1) for i in range(4)]


def test_hybrid_grid_across_processes_uses_jax_granules():
    grid = hybrid_grid(TWO_PROCESSES, (1, 4), (2, 1))
    assert np.vectorize(lambda d: d.process_index)(grid).tolist() == [[0] * 4, [1] * 4]
    grid = hybrid_grid(TWO_PROCESSES, (2, 2), (2, 1))
    assert np.vectorize(lambda d: d.process_index)(grid)[:, 0].tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("ici,dcn,match", [
    ((1, 8), (1, 1), "come from 2 processes"),
    ((1, 2), (2, 1), r"hold \[4\] devices each"),
])
def test_hybrid_grid_errors_name_processes(ici, dcn, match):
    with pytest.raises(ValueError, match=match):
        hybrid_grid(TWO_PROCESSES, ici, dcn)
