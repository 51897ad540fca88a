"""Idle-aware leases with real kernels: each holder's idleness shown to others, an idle kernel's lease given to a
waiter under the administrator's ``policy.toml``, a busy kernel's never, the holder's next cell told; the
per-user cap. Devices: one or two simulated GPUs (``GPUMAGIC_SIMULATE``)."""

import os
import re
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.kernel, pytest.mark.slow]

ONE_GPU = "1xA100-80GB"
TWO_GPUS = "2xA100-80GB"


def write_policy(lease_dir: Path, text: str, mode: int = 0o644) -> Path:
    """The administrator's policy.toml: root's, writable by nobody else (the suite runs as root, as CI does)."""
    if os.geteuid() != 0:
        pytest.skip("a policy.toml gpumagic honours must belong to root: run the suite as root, as CI does")
    path = lease_dir / "policy.toml"
    path.write_text(text)
    os.chmod(path, mode)
    return path


def started(start_kernel, gpus: str = ONE_GPU):
    kernel = start_kernel(GPUMAGIC_SIMULATE=gpus)
    kernel.ok("%load_ext gpumagic")
    return kernel


def test_an_idle_kernel_gives_its_lease_to_a_waiter_within_the_threshold_and_its_next_cell_says_so(
    start_kernel, isolated_leases
):
    """Two kernels idle past the threshold, one waiter for one GPU: exactly one gives its GPU back."""
    write_policy(isolated_leases, 'idle_release = "3s"\n')
    holders = [started(start_kernel, TWO_GPUS), started(start_kernel, TWO_GPUS)]
    waiter = started(start_kernel, TWO_GPUS)
    for holder in holders:
        assert "Picked GPU" in holder.ok("%gpu pick 1").all_text
    idle_from = time.monotonic()  # the last holder's cell has ended: both are idle from here
    picked = waiter.ok("%gpu pick 1 --wait 60s", timeout=90)
    waited = time.monotonic() - idle_from
    assert "Picked GPU" in picked.all_text
    print(f"the waiter got a GPU {waited:.2f} s after the holders went idle")
    assert 3.0 <= waited <= 3.0 + 8.0, waited  # the threshold, a look every 2 s, the waiter's 4 a second, a busy CI

    time.sleep(4.5)  # two more looks of each holder: neither gives a GPU to a waiter that has one
    told = [holder.ok("x = 1").stderr for holder in holders]
    said = [text for text in told if text]
    assert len(said) == 1, told  # exactly one holder gave its GPU (what each wrote, if not)
    (line,) = said
    assert re.fullmatch(
        r"gpumagic: this kernel's lease on GPU [01] was given to kernel .*, who waited, after this kernel was idle "
        r"3s \(.*policy.toml: idle_release\); CUDA_VISIBLE_DEVICES still names it: %gpu pick to pick again\n",
        line,
    ), line
    assert not any(holder.ok("y = 2").stderr for holder in holders)  # said once
    leased = [(holder.pid, "leased by this kernel" in holder.ok("%gpu").all_text) for holder in holders]
    assert sorted(kept for _, kept in leased) == [False, True], leased  # the other still holds its GPU
    status = waiter.ok("%gpu").all_text
    assert status.count("leased by this kernel") == 1


def test_a_busy_kernel_keeps_its_lease_and_idle_time_shows_to_others(start_kernel, isolated_leases):
    write_policy(isolated_leases, 'idle_release = "2s"\n')
    holder, other = started(start_kernel), started(start_kernel)
    holder.ok("%gpu pick 1")
    holder.ok("import time")
    shown = other.ok("%gpu").all_text
    assert re.search(rf"leased by root \(pid {holder.pid}\) since \d\d:\d\d, idle <1m", shown), shown
    assert "an idle kernel's lease goes to a waiter after 2s" in shown

    holder.client.execute("time.sleep(9)")  # a long cell: never idle while it runs, whoever waits
    deadline = time.monotonic() + 10
    while ", idle" in other.ok("%gpu").all_text and time.monotonic() < deadline:
        time.sleep(0.1)
    refused = other.run("%gpu pick 1 --wait 5s", timeout=60)
    assert refused.error is not None and f"leased by root (pid {holder.pid})" in refused.stderr, refused.stderr
    assert ", idle" not in refused.stderr  # busy, so not idle
    assert "Picked" in other.ok("%gpu pick 1 --wait 30s", timeout=60).all_text  # once the cell has ended


def test_the_per_user_cap_refuses_the_next_pick_naming_it(start_kernel, isolated_leases):
    path = write_policy(isolated_leases, "max_gpus_per_user = 1\n")
    first, second = started(start_kernel, TWO_GPUS), started(start_kernel, TWO_GPUS)
    assert "Picked GPU 0" in first.ok("%gpu pick 1").all_text
    refused = second.run("%gpu pick 1")
    assert refused.error is not None
    assert f"the administrator's policy ({path}) allows 1 GPU per user: root holds 1 (GPU 0)" in refused.stderr
    assert refused.stderr.strip().count("\n") == 0  # one line
    assert "Picked GPU 0" in first.ok("%gpu pick 1").all_text  # picking again replaces its own lease: allowed
    first.ok("%gpu release")
    assert "Picked GPU" in second.ok("%gpu pick 1").all_text
