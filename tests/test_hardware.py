"""Hardware profiles: the YAML files of the top-level profiles/ folder are the names a checkout and a
built wheel know, they load with the right units, round-trip, and bad files give one-line errors naming
the file and the field."""

import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.errors import UserError
from autoplan.hardware.profiles import (GB, GIB, half_of_ram_bytes, hardware_to_yaml, known_hardware,
                                        load_hardware, parse_hardware, profiles_dir)
from autoplan.hardware.types import Cluster

REQUIRED = {"a100-sxm4-80gb", "h100-sxm5-80gb", "h200-sxm-141gb", "cpu"}
ROOT = Path(__file__).resolve().parent.parent
"""The source checkout: pyproject.toml, autoplan/, profiles/, tests/."""


def test_packaged_profiles_include_the_common_gpus_and_this_machine():
    assert REQUIRED <= set(known_hardware())


def test_names_are_the_files_of_the_top_level_profiles_folder():
    # a file a user adds to profiles/ in a checkout is a name (--gpu NAME) without reinstalling
    assert profiles_dir() == ROOT / "profiles"
    assert known_hardware() == sorted(p.stem for p in (ROOT / "profiles").glob("*.yaml"))


def test_pyproject_ships_every_package_and_the_profiles_folder_as_autoplan_profiles():
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "autoplan").rglob("__init__.py")}
    assert set(setuptools["packages"]) == packages | {"autoplan.profiles"}, "list new packages in pyproject.toml"
    assert setuptools["package-dir"] == {"autoplan.profiles": "profiles"}
    assert setuptools["package-data"]["autoplan.profiles"] == ["*.yaml"]


@pytest.mark.slow
def test_a_built_wheel_ships_and_loads_the_top_level_profiles(tmp_path, built_wheel):
    shipped = sorted(Path(n).stem for n in built_wheel.wheel.namelist() if n.startswith("autoplan/profiles/"))
    assert shipped == known_hardware()
    site = built_wheel.site
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from autoplan.hardware import profiles as p; "
            "print(p.profiles_dir()); print(','.join(p.known_hardware())); print(p.load_hardware('h100-sxm5-80gb').gpu.name)")
    run = subprocess.run([sys.executable, "-c", code, str(site)], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(site / "autoplan" / "profiles"), ",".join(shipped), "h100-sxm5-80gb"]


@pytest.mark.parametrize("name", known_hardware())
def test_every_packaged_profile_loads_and_round_trips(name, tmp_path):
    profile = load_hardware(name)
    assert profile.gpu.name == name
    assert 0 < profile.gpu.matmul_efficiency <= 1 and 0 < profile.gpu.memory_efficiency <= 1
    assert Cluster(profile, 8, 8).usable_memory_bytes > 0
    assert profile.gpu.source and profile.intra_node.source and profile.inter_node.source
    path = tmp_path / f"{name}.yaml"
    path.write_text(hardware_to_yaml(profile))
    assert load_hardware(str(path)) == profile


def test_units_are_converted_from_the_field_names():
    a100 = load_hardware("a100-sxm4-80gb")
    assert a100.gpu.peak_flops["bf16"] == 312e12
    assert a100.gpu.peak_flops["fp32"] == 19.5e12
    assert a100.gpu.memory_bytes == 80 * GIB
    assert a100.gpu.memory_bandwidth_bytes_per_s == 2039 * GB
    assert a100.gpu.kernel_overhead_s == pytest.approx(5e-6)
    h100 = load_hardware("h100-sxm5-80gb")
    assert 460e9 <= h100.intra_node.bus_bandwidth_bytes_per_s <= 480e9  # nccl-tests 8xH100 busbw
    # 400 Gbit/s per GPU is 50 GB/s; achieved busbw is 0.8-0.9 of it
    assert 0.8 * 50e9 <= h100.inter_node.bus_bandwidth_bytes_per_s <= 0.9 * 50e9
    assert h100.intra_node.bus_bandwidth_bytes_per_s > 1.9 * a100.intra_node.bus_bandwidth_bytes_per_s


def test_cpu_profile_uses_half_of_this_machines_ram():
    cpu = load_hardware("cpu")
    assert cpu.gpu.memory_bytes == half_of_ram_bytes()
    assert cpu.intra_node.name == "loopback"
    assert "uncalibrated" in cpu.gpu.source


def _write(tmp_path, text):
    path = tmp_path / "hw.yaml"
    path.write_text(text)
    return path


def _valid_text():
    return hardware_to_yaml(load_hardware("a100-sxm4-80gb"))


def test_bad_yaml_names_the_file_and_line(tmp_path):
    path = _write(tmp_path, "name: x\ngpu: [unclosed\n")
    with pytest.raises(UserError, match=r"hw\.yaml: not valid YAML line \d+"):
        load_hardware(str(path))


def test_missing_field_is_named_with_its_path(tmp_path):
    text = "\n".join(line for line in _valid_text().splitlines() if "memory_bandwidth_gb_per_s" not in line)
    path = _write(tmp_path, text)
    with pytest.raises(UserError, match=r"hw\.yaml: missing field 'gpu\.memory_bandwidth_gb_per_s'"):
        load_hardware(str(path))


def test_ill_typed_field_is_named_with_the_bad_value(tmp_path):
    path = _write(tmp_path, _valid_text().replace("matmul_efficiency: 0.7", "matmul_efficiency: fast"))
    with pytest.raises(UserError, match=r"field 'gpu\.matmul_efficiency' must be a number, got 'fast'"):
        load_hardware(str(path))


def test_efficiency_above_one_is_rejected(tmp_path):
    path = _write(tmp_path, _valid_text().replace("memory_efficiency: 0.8", "memory_efficiency: 80"))
    with pytest.raises(UserError, match=r"'gpu\.memory_efficiency' must be at most 1\.0"):
        load_hardware(str(path))


def test_link_section_must_be_a_mapping(tmp_path):
    text = _valid_text().split("intra_node:")[0] + "intra_node: 5\ninter_node: 6\n"
    with pytest.raises(UserError, match=r"field 'intra_node' must be a mapping"):
        parse_hardware(text, _write(tmp_path, text))


def test_reserved_memory_must_leave_room(tmp_path):
    path = _write(tmp_path, _valid_text().replace("memory_reserved_gib: 5.5", "memory_reserved_gib: 90"))
    with pytest.raises(UserError, match=r"memory_reserved_gib \(90\.00 GiB\) must be less than gpu\.memory_gib"):
        load_hardware(str(path))


def test_unknown_name_lists_the_known_profiles():
    with pytest.raises(UserError, match=r"unknown hardware 'h900'.*a100-sxm4-80gb.*h100-sxm5-80gb"):
        load_hardware("h900")


def test_missing_file_is_reported(tmp_path):
    with pytest.raises(UserError, match="hardware profile file not found"):
        load_hardware(str(tmp_path / "nope.yaml"))


def test_measured_host_fields_round_trip(tmp_path):
    from dataclasses import replace

    from autoplan.calibrate.writer import HOST_FIELDS

    cpu = load_hardware("cpu")
    values = {attribute: 0.25 + i / 100 for i, (_, attribute, _, _) in enumerate(HOST_FIELDS)}
    values["concurrent_slowdown"] = 1.5
    profile = replace(cpu, gpu=replace(cpu.gpu, **values))
    path = tmp_path / "measured.yaml"
    path.write_text(hardware_to_yaml(profile))
    loaded = load_hardware(str(path))
    assert {a: getattr(loaded.gpu, a) for a in values} == pytest.approx(values)
