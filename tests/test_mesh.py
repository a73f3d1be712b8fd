import jax
import pytest

from jdist.errors import ConfigError
from jdist.spmd.axes import MESH_AXES
from jdist.spmd.mesh import FILL, build_mesh, dcn_sizes, parse_axes, parse_mesh, preset_names


def test_aliases_and_canonical_order():
    assert parse_axes("tp=2,dp=2,cp=2") == {"data": 2, "sequence": 2, "tensor": 2}
    assert parse_axes("tensor=4, stage=2,ep=1,sp=1") == {"stage": 2, "sequence": 1,
                                                          "expert": 1, "tensor": 4}


def test_fill_takes_the_remaining_devices():
    spec = parse_mesh("dp=-1,tp=2")
    assert spec.sizes["data"] == FILL
    assert spec.resolve(8)["data"] == 4
    assert spec.n_devices(default_fill=16) == 16


def test_every_axis_exists_in_canonical_order():
    mesh = build_mesh("tp=2,dp=4")
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {"data": 4, "stage": 1, "fsdp": 1, "sequence": 1, "expert": 1,
                                "tensor": 2}


def test_single_device_mesh():
    mesh = build_mesh("", jax.devices()[:1])
    assert mesh.devices.size == 1


@pytest.mark.parametrize("text, fragment", [
    ("dp2,tp=2", "malformed mesh entry"),
    ("dp2", "unknown mesh preset .dp2.; use AXIS=SIZE"),
    ("dp=two", "sizes are positive integers"),
    ("xx=2", "unknown mesh axis 'xx'"),
    ("dp=2,data=2", "given twice"),
    ("dp=0", "sizes are positive integers"),
    ("dp=-1,tp=-1", "more than one -1"),
    ("no-such-preset", "unknown mesh preset"),
    ("dp=2,,tp=2", "empty entry"),
    ("dp=2,tp=2,", "empty entry"),
])
def test_bad_mesh_strings(text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_mesh(text)


def test_mesh_must_match_device_count():
    with pytest.raises(ConfigError, match="needs 16 devices but 8 are available"):
        build_mesh("dp=2,tp=8")
    with pytest.raises(ConfigError, match="does not divide 8"):
        build_mesh("dp=3,tp=-1")


def test_presets_load():
    assert {"cpu-8", "gpu-1x8", "gpu-2x8"} <= set(preset_names())
    assert build_mesh("cpu-8").shape["fsdp"] == 2
    two_hosts = parse_mesh("gpu-2x8")
    assert two_hosts.resolve(16)["data"] == 2 and two_hosts.dcn == {"data": 2}


def test_data_axis_crosses_hosts_by_default():
    sizes = {a: 1 for a in MESH_AXES} | {"data": 2, "fsdp": 8}
    assert dcn_sizes(sizes, {}, 2)["data"] == 2
    assert dcn_sizes(sizes, {}, 2)["fsdp"] == 1
    sizes = {a: 1 for a in MESH_AXES} | {"fsdp": 16}
    assert dcn_sizes(sizes, {}, 2)["fsdp"] == 2  # no data axis: the next-slowest axis spans
