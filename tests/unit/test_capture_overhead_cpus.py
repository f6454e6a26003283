"""benchmarks/capture_overhead.py --cpus: CPU lists and NUMA nodes read as Linux writes them (a sysfs tree
made here), bad specs refused by name, and the host line every run prints."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import capture_overhead as co  # noqa: E402


def fake_sysfs(tmp_path: Path, nodes: dict[int, str]) -> str:
    for n, cpus in nodes.items():
        d = tmp_path / f"node{n}"
        d.mkdir()
        (d / "cpulist").write_text(cpus + "\n")
    (tmp_path / "possible").write_text("0-1\n")  # not a node directory: ignored
    return str(tmp_path)


def test_cpu_lists_and_nodes(tmp_path):
    assert co.cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    root = fake_sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"})
    assert co.numa_nodes(root) == {0: [0, 1, 2, 3, 8, 9, 10, 11], 1: [4, 5, 6, 7, 12, 13, 14, 15]}
    assert co.resolve_cpus("node:1", root) == [4, 5, 6, 7, 12, 13, 14, 15]
    assert co.resolve_cpus("2-3", root) == [2, 3]


def test_bad_specs_are_refused_by_name(tmp_path):
    root = fake_sysfs(tmp_path, {0: "0-1"})
    with pytest.raises(SystemExit, match=r"NUMA nodes are \[0\]"):
        co.resolve_cpus("node:3", root)
    with pytest.raises(SystemExit, match="bad CPU list"):
        co.resolve_cpus("0-x", root)
    with pytest.raises(SystemExit, match="not listed in"):
        co.resolve_cpus("node:0", str(tmp_path / "none"))


def test_host_line_names_the_cpus_this_run_may_use():
    line = co.host_line()
    assert line.startswith(f"host: {os.cpu_count()} CPUs") and f"may use {len(os.sched_getaffinity(0))} CPUs" in line
