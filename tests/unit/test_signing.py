"""Sealed pickles: payloads and results are checked against the user's key before they are unpickled, in
the ranks, in a job's runner and in the kernel; a changed or foreign file is refused with a clear error."""

import os
import stat

import pytest

import gpumagic
from gpumagic.launch.kernel_side import local
from gpumagic.run_dirs import signing
from gpumagic.run_dirs.signing import PayloadRejected, seal, unseal


@pytest.fixture
def own_key(tmp_path, monkeypatch):
    """A fresh key in a temporary state directory."""
    path = tmp_path / "state" / "payload.key"
    monkeypatch.setattr(signing, "key_path", lambda: path)
    monkeypatch.setattr(signing, "_cached", None)
    return path


def flip_last_byte(path):
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0x01
    path.write_bytes(bytes(blob))


def test_a_seal_opens_with_the_key_and_nothing_else(own_key):
    data = b"any pickle"
    assert unseal(seal(data), "it") == data
    assert stat.S_IMODE(own_key.stat().st_mode) == 0o600 and stat.S_IMODE(own_key.parent.stat().st_mode) == 0o700
    changed = bytearray(seal(data))
    changed[-1] ^= 1
    with pytest.raises(PayloadRejected, match="it does not carry your key's seal"):
        unseal(bytes(changed), "it")
    with pytest.raises(PayloadRejected, match="is not sealed by gpumagic"):
        unseal(data, "a plain pickle")
    sealed = seal(data)
    own_key.write_bytes(os.urandom(32))  # another user's key, in effect
    signing._cached = None
    with pytest.raises(PayloadRejected, match="does not carry your key's seal"):
        unseal(sealed, "a foreign pickle")


def test_a_key_others_can_read_is_refused(own_key):
    seal(b"x")
    own_key.chmod(0o644)
    signing._cached = None
    with pytest.raises(PayloadRejected, match=f"run `chmod 600 {own_key}`"):
        seal(b"x")


def test_a_rank_refuses_a_payload_changed_after_it_was_written(monkeypatch):
    original = signing.write_sealed

    def tampered(path, data):
        original(path, data)
        flip_last_byte(path)  # someone with write access to the directory edits the pickle

    monkeypatch.setattr(local, "write_sealed", tampered)  # where the launch writes the payload
    with pytest.raises(gpumagic.LaunchError) as caught:
        gpumagic.launch_ddp(print, nprocs=1, gpus="none")
    report = caught.value.report()
    assert "rank 0 failed: raised PayloadRejected: the code sent to the ranks" in report
    assert "does not carry your key's seal" in report and "(in setup)" in report


def test_a_job_refuses_a_payload_changed_while_it_waited(simulated, tmp_path):
    marker = tmp_path / "ran"

    def touch(path):
        import pathlib

        pathlib.Path(path).write_text("ran")

    gpumagic.use("GPU:*")  # the job waits in the queue while its payload is changed
    job = gpumagic.submit(touch, str(marker))
    flip_last_byte(job.path / "payload.pkl")
    gpumagic.release()
    assert job.wait("1m") == "failed"
    assert "does not carry your key's seal" in job.reason and "payload.pkl" in job.reason
    assert not marker.exists(), "the changed code never ran"
    with pytest.raises(gpumagic.JobFailed, match="does not carry your key's seal"):
        job.result()


def test_the_kernel_refuses_a_result_changed_after_the_job_wrote_it(simulated):
    job = gpumagic.jobs_with(gpus=0).submit(sum, [1, 2])
    assert job.result("1m") == 3
    flip_last_byte(job.path / "result.pkl")
    with pytest.raises(PayloadRejected, match=r"job sum's result .* does not carry your key's seal"):
        job.result()
