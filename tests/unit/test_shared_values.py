"""Big notebook values reach the ranks through shared memory, copy-on-write (issue #40). CPU ranks (gloo): no GPU.

Each test that counts shared memory makes its own tmpfs (root mounts it, as CI runs) and points ``GPUMAGIC_SHM``
there: what is used on it is what gpumagic holds, and nothing else on the machine writes to it.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

import gpumagic
from gpumagic.launch import shared_values
from gpumagic.launch.shipping import dumps

ROOT = Path(__file__).resolve().parents[2]
MB = 1 << 20


def wait_until(predicate, timeout=60.0, every=0.05):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(every)


def mount_tmpfs(path: Path, size: str) -> Path:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs of its own (CI runs as root)")
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=700", "tmpfs", str(path)], text=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    return path


def used(disk: Path) -> int:
    info = os.statvfs(disk)
    return (info.f_blocks - info.f_bfree) * info.f_frsize


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """A 64 MB tmpfs of this test's as ``GPUMAGIC_SHM``, files closed as soon as no launch or cell uses them."""
    disk = mount_tmpfs(tmp_path / "shm", "64m")
    monkeypatch.setenv(shared_values.SHM_VARIABLE, str(disk))
    monkeypatch.setenv(shared_values.KEEP_VARIABLE, "0")
    shared_values.close_kernel_store()  # made again from the variables
    yield disk
    shared_values.close_kernel_store()
    subprocess.run(["umount", "-l", str(disk)], check=True)


def store():
    return shared_values.kernel_store()


def mapped_from(address: int) -> str:
    """The file the mapping holding ``address`` maps in this process (``/proc/self/maps``)."""
    for line in open("/proc/self/maps"):
        fields = line.split()
        start, end = (int(part, 16) for part in fields[0].split("-"))
        if start <= address < end:
            return " ".join(fields[5:])
    return ""


def rank_view(x, y):
    """On a rank: where its X and Y live, their sums, and X[0], X[1] after each rank wrote X[rank] (barrier)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    where = (mapped_from(x.untyped_storage().data_ptr()), mapped_from(y.ctypes.data))
    sums = (float(x.sum()), float(y.sum()))
    x[rank] = 100 + rank
    y[0, 0] = -1
    dist.barrier()
    return where, sums, (float(x[0]), float(x[1]))


def test_a_launch_maps_big_values_from_shared_memory_copy_on_write(shm):
    X = torch.arange(2 * MB, dtype=torch.float32)  # 8 MB
    Y = np.ones((1024, 512))  # 4 MB, a NumPy array
    before = used(shm)
    results = gpumagic.launch_ddp(rank_view, 2, (X, Y), gpus="none", output="none")
    for rank, (where, sums, firsts) in results.items():
        assert all(path.startswith(f"{shm}/#") and path.endswith("(deleted)") for path in where), where
        assert sums == (float(X.sum()), float(Y.sum()))
        assert firsts == ((100.0, 1.0) if rank == 0 else (0.0, 101.0))  # its own write only
    assert float(X[0]) == 0.0 and float(X[1]) == 1.0 and Y[0, 0] == 1.0  # the kernel's as they were
    assert store().held_bytes() == 0  # GPUMAGIC_SHM_KEEP=0: closed at the launch's end
    wait_until(lambda: used(shm) == before)


def test_an_unchanged_value_is_not_written_again_and_a_changed_one_is(shm, monkeypatch):
    monkeypatch.setattr(store(), "keep_s", 600.0)
    X = torch.zeros(MB // 2)  # 2 MB
    A = np.zeros(MB // 4)  # 2 MB
    total = lambda x, a: (float(x.sum()), float(a.sum()))  # noqa: E731
    assert gpumagic.launch_ddp(total, 2, (X, A), gpus="none", output="none")[1] == (0.0, 0.0)
    assert store().writes == 2
    assert gpumagic.launch_ddp(total, 2, (X, A), gpus="none", output="none")[1] == (0.0, 0.0)
    assert store().writes == 2 and store().held_bytes() == 4 * MB
    X.add_(1)  # in place: the tensor's version changes
    A[7] = 5  # NumPy keeps no version: the bytes tell
    assert gpumagic.launch_ddp(total, 2, (X, A), gpus="none", output="none")[1] == (MB / 2, 5.0)
    assert store().writes == 4 and store().held_bytes() == 4 * MB  # the old files closed
    del X, A
    assert store().held_bytes() == 0  # freed with their values


@pytest.mark.slow
def test_launch_ddp_cells_share_big_values_and_a_no_wait_launch_frees_them_at_its_end(shm, shell):
    from gpumagic.launch.kernel_side.session import SESSION

    shell.user_ns.update(X=torch.ones(2 * MB), mapped_from=mapped_from, time=time)
    code = "mapped_from(X.untyped_storage().data_ptr())"
    shell.run_cell_magic("launch_ddp", "-n 2 --gpus none --no-dashboard -o where", code)
    assert all(path.startswith(f"{shm}/#") for path in shell.user_ns["where"].values())
    shell.run_cell_magic("launch_ddp", "-n 2 --gpus none --no-dashboard --no-wait -o later", f"time.sleep(1)\n{code}")
    assert store().held_bytes() == 8 * MB  # held while its ranks run (a second at least)
    SESSION.last_launch.join(60)
    assert all(path.startswith(f"{shm}/#") for path in shell.user_ns["later"].values())
    assert store().held_bytes() == 0


@pytest.mark.slow
def test_a_value_no_launch_uses_is_freed_after_the_keep_time(shm, monkeypatch):
    monkeypatch.setattr(store(), "keep_s", 2.0)
    X = torch.ones(MB)
    assert gpumagic.launch_ddp(lambda x: float(x.sum()), 2, (X,), gpus="none", output="none")[0] == MB
    assert store().held_bytes() == 4 * MB  # kept for the next launch
    wait_until(lambda: store().held_bytes() == 0, timeout=30)  # the keep timer closed it
    assert used(shm) == 0 and float(X.sum()) == MB


def test_a_kept_file_found_for_a_launch_is_held_before_a_sweep_can_close_it(shm, monkeypatch):
    """A kept file was found, then held a moment later: a sweep in between (the keep timer's thread) closed it,
    and the ranks were sent a descriptor that no longer named it."""
    monkeypatch.setattr(store(), "keep_s", 600.0)
    X = torch.ones(MB)
    with shared_values.sharing() as batch:
        dumps(X, batch)
    monkeypatch.setattr(store(), "keep_s", 0.0)  # kept, and due to be closed at the next sweep
    found = store().tensor_segment(X)  # what the pickler asks for the next launch
    store().sweep()
    assert found.fd >= 0 and os.fstat(found.fd).st_size == 4 * MB
    store().release([found])
    assert found.fd == -1 and store().held_bytes() == 0


def test_pickled_big_values_are_references_and_keep_what_they_were(shm):
    base = torch.arange(MB, dtype=torch.float64)
    frame = __import__("pandas").DataFrame({"a": np.arange(MB // 2, dtype=np.float64), "b": np.ones(MB // 2)})
    values = {
        "base": base,
        "view": base[10:20],
        "parameter": torch.nn.Parameter(torch.ones(512, 1024)),
        "fortran": np.asfortranarray(np.arange(MB, dtype=np.float32).reshape(1024, 1024)),
        "frame": frame,
        "dataset": torch.utils.data.TensorDataset(base),
        "small": torch.ones(3),
        "meta": torch.empty(MB, device="meta"),  # not on the CPU (as a CUDA tensor): torch's own pickle
    }
    with shared_values.sharing() as batch:
        data = dumps(values, batch)
        assert len(data) < 16 << 10  # references, not 8+ MB of bytes
        back = pickle.loads(data)  # in this process too, through /proc/self/fd
    assert torch.equal(back["base"], base) and torch.equal(back["view"], base[10:20])
    back["view"][0] = -1
    assert float(back["base"][10]) == -1 and float(base[10]) == 10  # a view shares its storage, copy-on-write
    assert type(back["parameter"]) is torch.nn.Parameter and back["parameter"].requires_grad
    assert back["fortran"].flags.f_contiguous and np.array_equal(back["fortran"], values["fortran"])
    assert back["frame"].equals(frame) and back["dataset"].tensors[0] is back["base"]  # one object, as pickled
    assert mapped_from(back["frame"]["b"].to_numpy().ctypes.data).startswith(f"{shm}/#")  # pandas' blocks too
    assert torch.equal(back["small"], values["small"])
    assert back["meta"].device.type == "meta" and back["meta"].shape == (MB,)
    assert store().held_bytes() == 0


def test_without_shared_memory_values_travel_by_value(tmp_path, monkeypatch):
    monkeypatch.setenv(shared_values.SHM_VARIABLE, "off")
    shared_values.close_kernel_store()
    try:
        assert shared_values.shared_batch() is None
        X = torch.arange(MB, dtype=torch.float32)
        assert gpumagic.launch_ddp(lambda x: float(x.sum()), 2, (X,), gpus="none", output="none")[0] == float(X.sum())
    finally:
        shared_values.close_kernel_store()


def test_a_full_tmpfs_is_one_line_and_the_values_travel_by_value(tmp_path, monkeypatch, capfd):
    disk = mount_tmpfs(tmp_path / "small", "2m")
    monkeypatch.setenv(shared_values.SHM_VARIABLE, str(disk))
    shared_values.close_kernel_store()
    try:
        X, Y = torch.ones(MB), torch.ones(MB)  # 4 MB each on 2 MB
        result = gpumagic.launch_ddp(lambda x, y: float(x.sum() + y.sum()), 2, (X, Y), gpus="none", output="none")
        assert result == {0: 2.0 * MB, 1: 2.0 * MB}
        said = [line for line in capfd.readouterr().err.splitlines() if "gpumagic" in line]
        assert said == [
            f"gpumagic: cannot share a 4 MiB value through {disk} (No space left on device): it and the rest of "
            "these values travel by value, a copy in each rank; free space there, or set GPUMAGIC_SHM to another "
            "tmpfs directory"
        ]
        assert used(disk) == 0 and store().held_bytes() == 0
    finally:
        shared_values.close_kernel_store()
        subprocess.run(["umount", "-l", str(disk)], check=True)


def die_on_rank_one(x):
    import torch.distributed as dist

    total = float(x.sum())
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return total


@pytest.mark.slow
def test_a_launch_whose_rank_is_killed_leaves_nothing_in_shared_memory(shm):
    X = torch.ones(2 * MB)
    with pytest.raises(gpumagic.LaunchError, match="rank 1"):
        gpumagic.launch_ddp(die_on_rank_one, 2, (X,), gpus="none", output="none")
    assert store().held_bytes() == 0
    wait_until(lambda: used(shm) == 0)


@pytest.mark.slow
def test_a_group_maps_big_values_once_and_a_replaced_rank_gets_them_again(shm, monkeypatch):
    monkeypatch.setattr(store(), "keep_s", 600.0)
    X = torch.arange(2 * MB, dtype=torch.float32)
    names = {"X": X, "mapped_from": mapped_from}
    with gpumagic.ranks(2, gpus="none", output="none") as group:
        where = group.exec("mapped_from(X.untyped_storage().data_ptr())", names)
        assert all(path.startswith(f"{shm}/#") for path in where.values()), where
        assert group.exec("X[rank] = 100 + rank; (float(X[0]), float(X[1]))", names) == {
            0: (100.0, 1.0),
            1: (0.0, 101.0),
        }
        assert float(X[0]) == 0.0 and store().writes == 1  # not written again for the second cell
        os.kill(group.status()[1].pid, signal.SIGKILL)
        wait_until(lambda: not group.status()[1].alive)
        where = group.exec("mapped_from(X.untyped_storage().data_ptr())", names)  # rank 1 replaced
        assert group.replaced == 1 and where[1].startswith(f"{shm}/#") and store().writes == 1
    monkeypatch.setattr(store(), "keep_s", 0.0)
    store().sweep()
    assert store().held_bytes() == 0
    wait_until(lambda: used(shm) == 0)


KERNEL = """
import json, sys, torch, gpumagic
X = torch.ones(4 << 20)
group = gpumagic.ranks(2, gpus="none", output="none")
group.exec("total = float(X.sum())", {"X": X})
print(json.dumps([row.pid for row in group.status()]), flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_a_kernel_killed_with_sigkill_leaves_nothing_in_shared_memory(shm):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    kernel = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KERNEL)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        ranks = [psutil.Process(pid) for pid in __import__("json").loads(kernel.stdout.readline())]
        assert used(shm) >= 16 * MB  # the kernel's file
        kernel.kill()
        kernel.wait()
        psutil.wait_procs(ranks, timeout=30)
        assert not any(rank.is_running() for rank in ranks)
        wait_until(lambda: used(shm) == 0)
    finally:
        kernel.kill()
        kernel.wait()


SHARE_AS_ALICE = """
import json, os, pickle, numpy
from gpumagic.launch import shared_values
from gpumagic.launch.shipping import dumps
batch = shared_values.shared_batch()
A = numpy.ones(1 << 18)
data = dumps(A, batch)
ref = batch.held[0].ref
result = [os.getpid(), ref.fd, ref.device, ref.inode, ref.nbytes]
"""

OPEN_AS_BOB = """
import json, os
from gpumagic.launch import shared_values
pid, fd, device, inode, nbytes = {args}
try:
    os.open(f"/proc/{{pid}}/fd/{{fd}}", os.O_RDONLY)
    opened = "opened"
except OSError as err:
    opened = type(err).__name__
try:
    shared_values.attach_buffer(pid, fd, device, inode, nbytes)
    attached = "attached"
except shared_values.SharedValueGone as err:
    attached = str(err)
print(json.dumps([opened, attached]))
"""


@pytest.mark.slow
def test_another_user_cannot_open_a_shared_value_and_none_has_a_name(two_users):
    alice, bob = two_users
    session = alice.session()
    try:
        pid, fd, device, inode, nbytes = session.run(SHARE_AS_ALICE)["value"]
        assert os.readlink(f"/proc/{pid}/fd/{fd}") == f"/dev/shm/#{inode} (deleted)"  # no name to open or squat
        opened, attached = bob.json(OPEN_AS_BOB.format(args=(pid, fd, device, inode, nbytes)))
        assert opened == "PermissionError"
        assert attached.startswith(f"a notebook value shared through /proc/{pid}/fd/{fd} cannot be opened")
    finally:
        session.process.kill()
        session.process.wait()
