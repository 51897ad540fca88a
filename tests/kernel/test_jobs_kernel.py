"""Background jobs from real kernels: a job outlives its kernel and a new kernel follows it; two kernels
submitting at once never share a GPU; %jobs watch streams every job's curve."""

import json
import threading
import time

import psutil
import pytest

import gpumagic

pytestmark = [pytest.mark.kernel, pytest.mark.usefixtures("no_job_left_running")]

TRAIN_CELL = """%%launch_bg --name A1 --gpus 1
for step in range(12):
    gpumagic.log(loss=scale / (step + 1))
    print(f"step {step}", flush=True)
    time.sleep(0.4)
{"final": scale / 12, "rank": rank}
"""


def test_a_job_outlives_its_kernel_and_a_new_kernel_follows_it(start_kernel, simulated):
    first = start_kernel(GPUMAGIC_SIMULATE=simulated)
    first.ok("%load_ext gpumagic\nimport time\nscale = 2.0")
    submitted = first.ok(TRAIN_CELL)
    assert "Submitted job A1" in submitted.all_text
    job = gpumagic.job("A1")
    deadline = time.monotonic() + 30
    while "step 1" not in job.logs() and time.monotonic() < deadline:
        time.sleep(0.05)
    runner = psutil.Process(job.info["runner_pid"])
    first.manager.interrupt_kernel()  # the kernel's interrupt does not reach the job
    first.shutdown()  # nor does its end
    assert runner.is_running() and job.status == "running"

    second = start_kernel(GPUMAGIC_SIMULATE=simulated)
    second.ok("%load_ext gpumagic\nimport gpumagic")
    listing = second.ok("%jobs")
    assert "A1" in listing.text[0] and "running" in listing.text[0] and "<table" in listing.html[0]
    followed = second.ok("%jobs logs A1 -f", timeout=60)
    assert [f"step {i}" for i in range(12)] == [line for line in followed.stdout.splitlines() if line]
    assert "[job A1: finished]" in followed.all_text
    result = second.ok("r = %jobs result A1\nprint(r)")
    assert result.stdout.strip() == "{'final': 0.16666666666666666, 'rank': 0}"
    metrics = second.ok(
        "m = gpumagic.job('A1').metrics()[0]['loss']\nprint(len(m), m.steps[-1], round(m.values[-1], 4))"
    )
    assert metrics.stdout.split() == ["12", "11.0", "0.1667"]
    table = second.ok("print(repr(gpumagic.list_jobs()[0]))").stdout
    assert table.startswith("Job(A1: finished on GPU 0") and "loss=0.1667 @ step 11" in table


def test_two_kernels_submitting_at_once_never_share_a_gpu(start_kernel, simulated):
    kernels = [start_kernel(GPUMAGIC_SIMULATE=simulated) for _ in range(2)]
    cell = """%load_ext gpumagic
def hold(seconds):
    import time
    time.sleep(seconds)
jobs = [gpumagic.submit(hold, 2.5) for _ in range(3)]
"""
    for kernel in kernels:
        kernel.ok("import gpumagic")
    barrier = threading.Barrier(2)
    outcomes = []

    def submit(kernel):
        barrier.wait()
        outcomes.append(kernel.run(cell))

    threads = [threading.Thread(target=submit, args=(k,)) for k in kernels]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [o.status for o in outcomes] == ["ok", "ok"]
    jobs = gpumagic.list_jobs()
    assert len(jobs) == 6 and len({j.name for j in jobs}) == 6
    assert [j.wait("2m") for j in jobs] == ["finished"] * 6
    spans = [(j.info["started"], j.info["ended"], set(j.info["gpus"])) for j in jobs]
    for i, (start_a, end_a, gpus_a) in enumerate(spans):
        for start_b, end_b, gpus_b in spans[i + 1 :]:
            if start_a < end_b and start_b < end_a:
                assert not gpus_a & gpus_b, f"two jobs ran on GPU {gpus_a & gpus_b} at once"
    concurrent = max(sum(1 for s, e, _ in spans if s <= t < e) for t, _, _ in spans)
    assert concurrent == 4, "all four GPUs were used at once"


def test_jobs_watch_streams_every_jobs_curve_and_offers_actions(simulated):
    from gpumagic.widgets.job_watch import JobWatch

    def curve(k):
        import time

        for step in range(6):
            gpumagic.log(loss=k + 1.0 / (step + 1), acc=step / 6)
            time.sleep(0.1)

    jobs = [gpumagic.jobs_with(name=f"v{k}").submit(curve, k) for k in range(3)]
    watch = JobWatch(interval=0.2)
    try:
        assert [j.wait("1m") for j in jobs] == ["finished"] * 3
        time.sleep(0.5)
        watch.update()
        assert [list(s.data["value"])[-1] for s in watch.sources.values()] == [1 / 6, 1 + 1 / 6, 2 + 1 / 6]
        assert all(len(s.data["step"]) == 6 for s in watch.sources.values())
        names = [row["box"].children[0].value for row in watch.rows.values()]
        assert names == ["<b>v0</b>", "<b>v1</b>", "<b>v2</b>"]
        assert all(row["kill"].disabled for row in watch.rows.values())  # nothing left to kill
        assert sorted(watch.metric_menu.options) == ["acc", "loss"]
        watch.metric_menu.value = "acc"
        watch.update()
        assert [list(s.data["value"])[-1] for s in watch.sources.values()] == [5 / 6] * 3
        watch.rows[jobs[0].path]["logs"].click()
        assert "v0</b>: last 30 lines" in watch.log_view.value
    finally:
        watch.close()
    assert not watch.running


def test_jobs_watch_kill_button_stops_a_job(simulated):
    from gpumagic.widgets.job_watch import JobWatch

    def forever():
        import time

        while True:
            time.sleep(0.1)

    job = gpumagic.jobs_with(name="endless").submit(forever)
    watch = JobWatch(interval=0.2)
    try:
        deadline = time.monotonic() + 30
        while job.status != "running" and time.monotonic() < deadline:
            time.sleep(0.05)
        watch.update()
        watch.rows[job.path]["kill"].click()
        assert job.wait("30s") == "killed"
        deadline = time.monotonic() + 5
        while "killed" not in watch.message.value and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch.message.value == "endless: killed (killed with %jobs kill)"
    finally:
        watch.close()


def test_jobs_watch_in_a_kernel_is_a_widget(start_kernel, simulated):
    kernel = start_kernel(GPUMAGIC_SIMULATE=simulated)
    kernel.ok("%load_ext gpumagic")
    shown = kernel.ok("%jobs watch --metric loss")
    assert "application/vnd.jupyter.widget-view+json" in shown.mimetypes
    threads = kernel.ok("import threading; print(sorted(t.name for t in threading.enumerate()))").stdout
    assert "gpumagic-job-watch" in threads
    kernel.ok("%jobs watch")  # a second watch replaces the first
    threads = json.loads(kernel.ok("import json; print(json.dumps([t.name for t in threading.enumerate()]))").stdout)
    assert threads.count("gpumagic-job-watch") == 1
