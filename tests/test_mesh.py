"""make_mesh: prime-factor axes, explicit shapes, Auto axis types, clear errors."""

import jax
import pytest
from jax.sharding import AxisType

from jaxpar.mesh import make_mesh, prime_factors


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


def test_platform_selection():
    assert make_mesh(2, device="CPU").devices.flat[0].platform == "cpu"


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


def test_missing_platform_is_a_clear_error():
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("a GPU is present, so the missing-platform path cannot be exercised")
    with pytest.raises(ValueError, match="no GPU devices"):
        make_mesh(2, device="GPU")
