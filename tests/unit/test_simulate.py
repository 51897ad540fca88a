"""The simulated inventory: specs, scenario files, and real processes counting against simulated GPUs."""

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

import gpumagic
from gpumagic.devices import simulate
from gpumagic.errors import InvalidArgument
from gpumagic.units import GIB


def test_spec_forms():
    assert [g.name for g in simulate.parse_spec("2xA100-80GB,1xV100-16GB")] == [
        "NVIDIA A100-80GB",
        "NVIDIA A100-80GB",
        "NVIDIA V100-16GB",
    ]
    assert simulate.parse_spec("8xH100")[0].memory_total == 80 * GIB
    assert simulate.parse_spec("T4")[0].memory_total == 16 * GIB


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("4xFOO", "give FOO's memory"),
        ("0xA100", "1-64 GPUs"),
        ("lots of gpus", "cannot read"),
        (",", "describes no GPU"),
        ("65xA100", "1-64"),
        ("/nonexistent/x.json", "cannot read"),
    ],
)
def test_bad_specs_are_clear(spec, message):
    with pytest.raises(InvalidArgument, match=message):
        simulate.parse_spec(spec)


def test_everything_is_labelled_simulated(simulated):
    inventory = gpumagic.gpus()
    assert inventory.simulated and inventory.simulation == "4xA100-80GB"
    assert all(g.simulated for g in inventory) and "simulated" in repr(inventory)
    assert "SIMULATED" in repr(gpumagic.status())


def test_uuids_are_stable_across_processes(simulated):
    code = "import gpumagic; print(','.join(g.uuid for g in gpumagic.gpus()))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == ",".join(g.uuid for g in gpumagic.gpus())


def test_a_process_on_one_simulated_servers_gpu_is_not_on_another_servers(simulated, tmp_path, monkeypatch):
    """A simulated server is its spec and its lease directory: a process started on one server's GPU 1 uses that
    GPU's memory there and nowhere else (tests side by side each simulate their own server)."""
    gpu = gpumagic.gpus()[1]
    code = "import sys; print('up', flush=True); sys.stdin.read()"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu.uuid}
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        assert process.stdout.readline() == b"up\n"
        assert [p.pid for p in gpumagic.gpus()[1].processes] == [process.pid]
        monkeypatch.setenv("GPUMAGIC_LEASE_DIR", str(tmp_path / "another-server"))
        other = gpumagic.gpus()
        assert other[1].uuid != gpu.uuid and all(not g.processes for g in other)
    finally:
        process.kill()
        process.wait()


def test_scenario_file_with_load_processes_and_a_lost_gpu(tmp_path, monkeypatch):
    scenario = {
        "gpus": [
            {
                "model": "A100-80GB",
                "used": "30GB",
                "utilization": 90,
                "processes": [{"pid": 4242, "user": "alice", "command": "python train.py", "memory": "30GB"}],
            },
            {"model": "V100-16GB", "count": 2},
            {"model": "A100-80GB", "lost": True},
        ]
    }
    path = tmp_path / "server.json"
    path.write_text(json.dumps(scenario))
    monkeypatch.setenv("GPUMAGIC_SIMULATE", str(path))
    inventory = gpumagic.gpus()
    assert len(inventory) == 4 and inventory.simulation == "server.json"
    busy = inventory[0]
    assert busy.memory_used == 30 * GIB and busy.utilization == 90
    assert busy.processes[0].user == "alice" and busy.processes[0].simulated
    assert inventory[1].memory_total == 16 * GIB and inventory[2].name == "NVIDIA V100-16GB"
    assert not inventory[3].healthy


def test_bad_scenario_file_names_the_entry(tmp_path, monkeypatch):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"gpus": [{"model": "A100-80GB"}, {"memory": "lots"}]}))
    monkeypatch.setenv("GPUMAGIC_SIMULATE", str(path))
    with pytest.raises(InvalidArgument, match="GPU entry 1"):
        gpumagic.gpus()


def test_a_process_started_on_a_simulated_gpu_uses_its_memory_and_utilization(simulated):
    """After %gpu pick, a child that allocates 400 MB and spins shows up on the GPU it was given."""
    chosen = gpumagic.pick(1)
    gpu = chosen.gpus[0]
    code = "b = bytearray(400 * 2**20)\nimport time\nt = time.time()\nwhile time.time() - t < 20: pass"
    child = subprocess.Popen([sys.executable, "-c", code])  # inherits CUDA_VISIBLE_DEVICES from pick
    try:
        deadline = time.time() + 10
        while time.time() < deadline:
            now = gpumagic.gpus()[gpu.nvml_index]
            seen = any(p.pid == child.pid for p in now.processes)
            if seen and now.memory_used >= 400 * 2**20 and now.utilization > 20:
                break
            time.sleep(0.3)
        assert any(p.pid == child.pid for p in now.processes)
        assert now.memory_used >= 400 * 2**20 and now.utilization > 20
        others = [g for g in gpumagic.gpus() if g.nvml_index != gpu.nvml_index]
        assert all(g.memory_used == 0 for g in others)
        # picking again avoids the GPU our child now loads, and gives its lease back
        again = gpumagic.pick(1)
        assert again.gpus[0].nvml_index != gpu.nvml_index
        from gpumagic.devices import leases

        assert leases.book().held() == (again.gpus[0].uuid,)
    finally:
        child.kill()
        child.wait()


def test_a_process_seen_before_its_exec_is_read_again_after_it(simulated):
    """A scan that meets a process before it execs (a child between fork and exec shows its parent's
    environment) must not keep that view: after the exec it counts against the GPU its new environment names."""
    gpu = gpumagic.gpus()[1]
    script = f"while [ ! -e go ]; do sleep 0.01; done; exec env CUDA_VISIBLE_DEVICES={gpu.uuid} sleep 30"
    with tempfile.TemporaryDirectory() as place:
        child = subprocess.Popen(["sh", "-c", script], cwd=place, env={"PATH": "/usr/bin:/bin"})
        try:
            assert not any(p.pid == child.pid for p in gpumagic.gpus()[1].processes)  # a shell without the variable
            open(f"{place}/go", "w").close()
            deadline = time.time() + 10
            while time.time() < deadline and open(f"/proc/{child.pid}/comm").read().strip() != "sleep":
                time.sleep(0.01)
            assert any(p.pid == child.pid for p in gpumagic.gpus()[1].processes)
        finally:
            child.kill()
            child.wait()
