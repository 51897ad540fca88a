"""pick / use / release: policy, reasons, leases and the environment they set."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

import gpumagic
from gpumagic.devices.spec import SpecError
from gpumagic.errors import GpuLeasedError, InvalidArgument, NoGpuError, NotEnoughGpusError


@pytest.fixture
def busy_server(tmp_path, monkeypatch):
    """GPU 0: 30 GiB used, 90% busy; GPU 1: 70 GiB used; GPU 2, 3: idle; GPU 4: lost."""
    scenario = {
        "gpus": [
            {
                "model": "A100-80GB",
                "utilization": 90,
                "processes": [{"pid": 4242, "user": "alice", "command": "python train.py", "memory": "30GB"}],
            },
            {"model": "A100-80GB", "used": "70GB", "utilization": 10},
            {"model": "A100-80GB", "used": "1GB", "utilization": 5},
            {"model": "A100-80GB"},
            {"model": "A100-80GB", "lost": True},
        ]
    }
    path = tmp_path / "busy.json"
    path.write_text(json.dumps(scenario))
    monkeypatch.setenv("GPUMAGIC_SIMULATE", str(path))
    return path


def test_pick_takes_the_most_free_then_least_busy(busy_server):
    chosen = gpumagic.pick(2)
    assert chosen.indices == (2, 3)
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ",".join(chosen.uuids)
    assert "Picked GPU 2, 3" in repr(chosen) and "cuda:0=GPU 2, cuda:1=GPU 3" in repr(chosen)
    assert repr(chosen).endswith("[simulated]") and "\n" not in repr(chosen)


def test_too_few_lists_what_each_gpu_lacked(busy_server):
    with pytest.raises(NotEnoughGpusError) as caught:
        gpumagic.pick(3, min_free="40GB", max_util=50)
    error = caught.value
    assert error.chosen == (3, 2) and error.wanted == 3
    assert "50.0 GiB free < 40.0 GiB" not in error.reasons[0]  # 50 GiB free is enough
    assert "90% busy > 50% allowed" in error.reasons[0]
    assert "10.0 GiB free < 40.0 GiB needed" in error.reasons[1]
    assert "lost" in error.reasons[4]
    assert "--wait" in str(error)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_percent_free_and_exclude(busy_server):
    assert gpumagic.pick(1, min_free="95%", exclude="3").indices == (2,)
    assert gpumagic.pick(1, exclude=[2, 3]).indices == (0,)  # 50 GiB free beats 10 GiB


def test_bad_arguments_are_invalid_argument(busy_server):
    for call in (
        lambda: gpumagic.pick(0),
        lambda: gpumagic.pick("2"),
        lambda: gpumagic.pick(1, min_free="lots"),
        lambda: gpumagic.pick(1, max_util=150),
        lambda: gpumagic.pick(1, wait="soon"),
        lambda: gpumagic.pick(1, exclude="9"),
    ):
        with pytest.raises(InvalidArgument):
            call()


def test_more_than_the_machine_has_fails_without_waiting(busy_server):
    started = time.monotonic()
    with pytest.raises(NotEnoughGpusError, match="only 5 GPUs"):
        gpumagic.pick(6, wait="1h")
    assert time.monotonic() - started < 5


@pytest.mark.slow
def test_wait_returns_once_a_gpu_is_released(busy_server):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import gpumagic, time; gpumagic.pick(2); print('held', flush=True); time.sleep(2)"],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    assert holder.stdout.readline().strip() == "held"
    heard = []
    chosen = gpumagic.pick(1, min_free="60GB", wait="30s", poll_interval=0.2, on_wait=heard.append)
    holder.wait()
    assert chosen.indices in ((2,), (3,))
    assert heard and "Waiting for 1 GPU" in heard[0] and "leased by" in heard[0]


def test_wait_times_out_with_the_reasons(busy_server):
    with pytest.raises(NotEnoughGpusError, match="after waiting 1s"):
        gpumagic.pick(1, min_free="80.5GB", wait="1s", poll_interval=0.2)


def test_use_named_gpus_and_numbering(busy_server):
    chosen = gpumagic.use("['GPU:3', 'GPU:0']")
    assert chosen.indices == (0, 3)
    assert gpumagic.visible_gpus().nvml_indices == (0, 3)
    assert "cuda:0=GPU 0, cuda:1=GPU 3" in repr(chosen)


def test_use_refuses_gpus_leased_by_others_unless_forced(busy_server):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import gpumagic, sys; gpumagic.use('2'); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(GpuLeasedError, match=f"GPU 2 is leased by .*pid {holder.pid}.*--force"):
            gpumagic.use("2,3")
        forced = gpumagic.use("2,3", force=True)
        assert forced.indices == (2, 3) and forced.shared == (2,) and "without a lease" in repr(forced)
    finally:
        holder.stdin.close()
        holder.wait(10)


@pytest.mark.parametrize("spec", ["| cat /etc/passwd", "x?", "A100|", ".*"])
def test_a_name_pattern_that_matches_an_empty_name_is_refused(busy_server, spec):
    with pytest.raises(SpecError, match="matches an empty name, so it would name every GPU; write GPU:\\* or all"):
        gpumagic.use(spec)
    with pytest.raises(SpecError, match="accepted: 0,2"):
        gpumagic.pick(1, exclude=spec)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and gpumagic.release() == ()


def test_use_a_lost_gpu_is_refused(busy_server):
    with pytest.raises(SpecError, match="GPU 4 cannot be used: GPU is lost"):
        gpumagic.use("4")


def test_use_none_hides_every_gpu_and_gives_leases_back(busy_server):
    gpumagic.pick(2)
    chosen = gpumagic.use("cpu")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and chosen.indices == ()
    assert gpumagic.visible_gpus().nvml_indices == ()
    from gpumagic.devices import leases

    assert leases.book().held() == ()


def test_release_restores_the_environment_from_before(busy_server, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    gpumagic.pick(1)
    gpumagic.use("0,3")
    assert gpumagic.release() == (0, 3)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1" and "CUDA_DEVICE_ORDER" not in os.environ


def test_pick_on_fake_nvml_skips_the_lost_and_busy_gpus(fake_nvml):
    chosen = gpumagic.pick(2)
    assert chosen.indices == (0, 2) and not chosen.simulated
    assert (
        os.environ["CUDA_VISIBLE_DEVICES"]
        == "GPU-0f4ea0c3-6ad2-1b4e-c3f1-6b2e0d9c1a01,GPU-c3d5f0aa-1234-4c56-9abc-def012345603"
    )
    with pytest.raises(NotEnoughGpusError) as caught:
        gpumagic.pick(3, min_free="30GB")
    assert "lost" in caught.value.reasons[3] and "19.5 GiB free < 30.0 GiB needed" == caught.value.reasons[1]


def test_no_driver_is_a_clear_error(no_gpu_machine):
    with pytest.raises(NoGpuError, match=r"no NVIDIA GPU or driver found.*GPUMAGIC_SIMULATE"):
        gpumagic.pick(1)


def test_concurrent_threads_in_one_process_do_not_corrupt_leases(busy_server):
    results, errors = [], []

    def worker():
        try:
            results.append(gpumagic.pick(1).indices)
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 4
    from gpumagic.devices import leases

    assert len(leases.book().held()) == 1  # each pick replaces this process's choice
