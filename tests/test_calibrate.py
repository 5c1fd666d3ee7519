"""jaxpar calibrate: the alpha-beta fit inverts comm.py's model, a run on 8 CPU devices writes a
profile that loads and drives jaxpar.shard, and profiles round-trip through YAML."""

import ast

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar.calibrate import KINDS, Settings, calibrate, fit_link, main
from jaxpar.cost.comm import Collective, collective_time
from jaxpar.cost.hardware import (
    Link,
    available_profiles,
    load_profile,
    profile_from_dict,
    profile_to_dict,
    save_profile,
)
from jaxpar.mesh import available_platforms, make_mesh
from jaxpar.spec import MeshInfo


@pytest.mark.parametrize("topology", ["switch", "ring"])
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_fit_gives_back_the_link_comm_prices_with(kind, n, topology):
    link = Link("x", bandwidth=37e9, latency=3e-6, topology=topology)
    mesh = MeshInfo(("x",), (n,))
    small, large = 1024.0, 8.0 * 2**20
    t = [collective_time(Collective(kind, ("x",), b), mesh, {"x": link}) for b in (small, large)]
    bandwidth, latency = fit_link(kind, n, topology, small, t[0], large, t[1])
    assert bandwidth == pytest.approx(37e9, rel=1e-9)
    assert latency == pytest.approx(3e-6, rel=1e-6)


def test_noisy_timings_fall_back_to_the_large_message():
    bandwidth, latency = fit_link("all-gather", 2, "switch", 1024, 5e-3, 2**20, 1e-3)
    assert bandwidth == pytest.approx(0.5 * 2**20 / 1e-3) and latency >= 0.0


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    path = tmp_path_factory.mktemp("calibrate") / "cpu8.yaml"
    code = main(["--mesh", "2,4", "--names", "node,gpu", "--out", str(path), "--quick",
                 "--memory-gb", "2", "--name", "test-cpu8"])
    return code, path


def test_calibrate_writes_a_profile_that_loads(calibrated, capsys):
    code, path = calibrated
    assert code == 0 and path.is_file()
    p = load_profile(path)
    assert p.name == "test-cpu8" and p.memory_bytes == 2e9 and p.nodes == 1
    assert p.peak_flops > 1e8 and p.memory_bandwidth > 1e7  # any CPU does better
    assert set(p.axes) == {"node", "gpu"}
    for link in p.axes.values():
        assert link.bandwidth > 1e6 and link.latency >= 0 and link.topology == "switch"
        assert set(link.collectives) == set(KINDS) - {"all-reduce"}
        assert all(link.figures(k)[0] > 1e6 for k in KINDS)
    assert p.intra in p.axes.values() and p.inter is None  # one process: no inter link
    assert p.axis_links(MeshInfo(("node", "gpu"), (2, 4))) == p.axes
    assert "Measured by `jaxpar calibrate` on 8 cpu" in path.read_text()
    assert "peak_flops: float32 matmuls" in path.read_text()


def test_peak_flops_in_the_programs_matmul_dtype():
    # One device: no links, only the matmul and the memory copy are timed.
    one = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    cal = calibrate(one, quick=True, matmul_dtype="bfloat16")
    assert cal.profile.peak_flops > 0 and any("bfloat16 matmuls" in n for n in cal.notes)
    with pytest.raises(ValueError, match="matmul_dtype='int8'"):
        calibrate(one, matmul_dtype="int8")


@pytest.mark.parametrize("kwargs,error,match", [
    # each measured for seconds and came back as a profile jaxpar then refused (name 5,
    # 0.5 bytes), with NaN figures (trials=0), or wrong and usable (sizes swapped: latency 0,
    # 7.9 MB/s); a dict for settings failed with an AttributeError inside
    ({"name": 5}, ValueError, "calibrate\\(name=5\\): give the profile's name as a non-empty"),
    ({"name": ""}, ValueError, "calibrate\\(name=''\\)"),
    ({"memory_bytes": 0.5}, ValueError, "memory_bytes=0.5\\): give the memory per device in "
                                        "bytes \\(a finite number of at least 1\\)"),
    ({"quick": "no"}, TypeError, "calibrate\\(quick='no'\\): pass True or False"),
    ({"settings": {"trials": 3}}, TypeError, "pass a jaxpar.calibrate.Settings"),
])
def test_bad_calibrate_arguments_are_refused_before_measuring(kwargs, error, match, monkeypatch):
    monkeypatch.setattr("jaxpar.calibrate._measure_axis", None)  # never reached
    with pytest.raises(error, match=match):
        calibrate(make_mesh((8,), ("d0",)), **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"trials": 0}, "Settings\\(trials=0\\): give an int of at least 1"),
    ({"small_bytes": -1}, "Settings\\(small_bytes=-1\\)"),
    ({"small_bytes": 1 << 20, "large_bytes": 1 << 10}, "the latency message must be smaller"),
    ({"target_s": 0.0}, "Settings\\(target_s=0.0\\)"),
    ({"matmul_size": 2.5}, "Settings\\(matmul_size=2.5\\)"),
    ({"matmul_dtype": "int8"}, "Settings\\(matmul_dtype='int8'\\)"),
])
def test_bad_settings_are_refused_when_made(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Settings(**kwargs)
    assert Settings(trials=1, matmul_size=0).trials == 1  # the defaults' own values pass


def test_calibrated_profile_drives_shard(calibrated):
    _, path = calibrated
    mesh = make_mesh((2, 4), ("node", "gpu"))

    def f(x, w):
        return jnp.tanh(x @ w).sum(axis=0)

    x = jax.random.normal(jax.random.key(0), (16, 32))
    w = jax.random.normal(jax.random.key(1), (32, 64))
    g = jaxpar.shard(f, mesh=mesh, search_mode="dynamic_programming", hardware=str(path))
    assert g.plan(x, w).hardware == "test-cpu8"
    np.testing.assert_allclose(g(x, w), jax.jit(f)(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("argv,match", [
    (["--mesh", "2,x"], "comma-separated axis sizes"),
    (["--mesh", "2,4", "--devices", "4"], "--mesh 2,4 has 8 devices but --devices is 4"),
    (["--mesh", "2,4", "--names", "a"], "name each of the 2"),
    (["--names", "a,b"], "give --mesh with one size per name"),
    (["--devices", "0"], "positive device count"),
    (["--memory-gb", "-1"], "--memory-gb -1.0"),
    (["--memory-gb", "inf"], "--memory-gb inf: give the memory per device in GB, a finite"),
    (["--memory-gb", "nan"], "--memory-gb nan"),
    # wrote a profile of 0.1 bytes that no plan could then load
    (["--memory-gb", "1e-10"], "--memory-gb 1e-10: give the memory per device in GB, a finite "
                               "number of a byte (1e-9) or more"),
])
def test_bad_arguments_exit_2_with_a_message(argv, match, capsys, tmp_path):
    assert main(argv + ["--out", str(tmp_path / "never-written.yaml")]) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "never-written.yaml").exists()


def test_a_mesh_alone_asks_for_as_many_devices(tmp_path, monkeypatch, capsys):
    # `--mesh 3,3` without --devices started JAX with one CPU device, then refused the mesh.
    import jaxpar.calibrate as cal

    asked = []

    def start(devices, device):
        asked.append(devices)
        raise ValueError("stop here")

    monkeypatch.setattr(cal, "_start_backend", start)
    assert main(["--mesh", "3,3", "--out", str(tmp_path / "p.yaml")]) == 2
    assert main(["--mesh", "3,3", "--devices", "9", "--out", str(tmp_path / "p.yaml")]) == 2
    assert main(["--out", str(tmp_path / "p.yaml")]) == 2
    assert asked == [9, 9, None]



@pytest.mark.parametrize("argv,match", [
    (["--devices", "100000"], "--devices 100000: must be a positive device count of at most 4096"),
    (["--mesh", "100000"], "--mesh 100000 has 100000 devices; at most 4096"),
    (["--mesh", "1000,1000", "--devices", "8"], "--mesh 1000,1000 has 1000000 devices; at most"),
    (["--mesh", "0,4"], "--mesh 0,4: axis sizes must be positive"),
])
def test_device_counts_past_the_cap_are_refused_before_jax_starts(argv, match, monkeypatch,
                                                                    capsys, tmp_path):
    # --devices 100000 went on to ask JAX for 100000 simulated CPU devices: 19 GB, no output.
    import jaxpar.calibrate as cal

    monkeypatch.setattr(cal, "_start_backend", lambda *a: pytest.fail("started JAX"))
    assert main(argv + ["--out", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxpar calibrate: error: ") and err.count("\n") == 1 and match in err

def test_an_output_path_that_cannot_be_written_is_refused_before_measuring(tmp_path, capsys):
    # (it had measured for a while, then failed inside pathlib)
    assert main(["--mesh", "2,4", "--out", str(tmp_path / "missing" / "p.yaml")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "does not exist" in err
    assert main(["--mesh", "2,4", "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("name", available_profiles())
def test_profiles_round_trip_through_yaml(name, tmp_path):
    p = load_profile(name)
    assert load_profile(save_profile(p, tmp_path / f"{name}.yaml", "a comment")) == p
    assert profile_from_dict(profile_to_dict(p)) == p


@pytest.mark.parametrize("change,match", [
    ({"intra": {"name": "l", "bandwidth": 1e9, "latency": 1e-6, "topology": "torus"}},
     "topology='torus'"),
    ({"intra": {"name": "l", "bandwidth": -1, "latency": 1e-6}}, "bandwidth=-1"),
    ({"intra": {"name": "l", "bandwidth": "fast", "latency": 1e-6}}, "bandwidth='fast'"),
    ({"devices_per_node": -8}, "devices_per_node=-8"),
    ({"nodes": 1.5}, "nodes=1.5"),
    ({"axes": {"gpu": {"name": "l", "bandwidth": 1e9}}}, r"axes.gpu: missing keys \['latency'\]"),
])
def test_bad_profile_fields_are_named(change, match):
    base = {"name": "t", "peak_flops": 1e12, "memory_bytes": 1e9, "memory_bandwidth": 1e11,
            "intra": {"name": "l", "bandwidth": 1e9, "latency": 1e-6}}
    with pytest.raises(ValueError, match=match):
        profile_from_dict({**base, **change})


def test_yaml_numbers_without_a_dot_still_load(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("name: p\npeak_flops: 1e12\nmemory_bytes: 16e9\nmemory_bandwidth: 8e11\n"
                    "intra: {name: ici, bandwidth: 9e10, latency: 1e-6, topology: ring}\n")
    p = load_profile(path)  # YAML 1.1 reads 1e12 as a string
    assert p.peak_flops == 1e12 and p.intra.bandwidth == 9e10
    assert Link("l", 1e9, 1e-6, collectives={"all-to-all": {"bandwidth": 5e8}}).figures(
        "all-to-all") == (5e8, 1e-6)


def test_a_missing_platform_gets_jaxpars_message(tmp_path, capsys):
    # `--device GPU` alone printed JAX's raw "Unknown backend: 'gpu' requested"; with
    # --devices it already went through make_mesh's message.
    missing = [kind for kind in ("GPU", "TPU") if kind not in available_platforms()]
    if not missing:
        pytest.skip("a GPU and a TPU are both present: no platform is missing to ask for")
    kind = missing[0]  # GPU here (CI is CPU only); on a GPU machine, TPU
    for argv in (["--device", kind], ["--device", kind, "--devices", "2"]):
        assert main(argv + ["--out", str(tmp_path / "p.yaml")]) == 2
        err = capsys.readouterr().err
        assert f"device='{kind}': no {kind} devices are visible to JAX" in err
        assert "Unknown backend" not in err


def test_an_out_path_without_a_suffix_loads_as_printed(tmp_path, monkeypatch, capsys):
    # The printed hardware='calprof' read as a profile name (configs/hardware/calprof.yaml).
    monkeypatch.chdir(tmp_path)
    one = ["--devices", "1", "--quick", "--memory-gb", "1", "--name", "bare"]
    assert main(one + ["--out", "calprof"]) == 0
    hint = capsys.readouterr().out.rsplit("hardware=", 1)[1].strip().rstrip(")")
    assert hint == "'./calprof'" and load_profile(ast.literal_eval(hint)).name == "bare"
    assert load_profile("calprof").name == "bare"  # no such profile name: the file
    assert load_profile(tmp_path / "calprof").name == "bare"
    (tmp_path / "cpu").write_text((tmp_path / "calprof").read_text())
    assert load_profile("cpu").name == "cpu"  # a profile name wins over a file of that name
    assert load_profile("./cpu").name == "bare"


@pytest.mark.parametrize("same_host", [True, False])
def test_host_ram_is_shared_among_the_devices_of_every_process_on_the_host(monkeypatch,
                                                                            same_host):
    # Under `jaxpar launch -n 2 --devices-per-process 2` each process divided the host's RAM
    # by its own 2 devices: 2x the memory per device, in the profile it wrote.
    from jax.experimental import multihost_utils

    def allgather(row):  # this process and one more, on this host or another
        other = row.copy()
        if not same_host:
            other[0] += 1
        return np.stack([row, other])

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    import os

    from jaxpar import calibrate as calibration

    mesh = jaxpar.make_mesh(8)  # CPU devices report no memory: the host's RAM is shared
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    sharing = 8 * (2 if same_host else 1)
    memory, notes = calibration._memory_per_device(mesh, None)
    assert memory == ram / sharing
    assert f"shared among {sharing} devices" in notes[0]
