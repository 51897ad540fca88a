"""One ``LaunchOptions`` value, checked once: the same one-line refusal from the value, the launch API,
``check_launch`` and ``%%launch_ddp``; one ``LaunchHandle`` for every launch that runs in the background; one
writer of the torchrun variables."""

import contextlib
import threading

import pytest
from IPython.core.error import UsageError

import gpumagic
from gpumagic.errors import InvalidArgument
from gpumagic.jobs.api import JobRequest
from gpumagic.jobs.slurm_task import torchrun_environment
from gpumagic.launch.kernel_side.ddp import check_launch
from gpumagic.launch.kernel_side.group import RankGroup
from gpumagic.launch.kernel_side.launch_handle import LaunchHandle
from gpumagic.launch.kernel_side.session import SESSION
from gpumagic.launch.options import LaunchOptions
from gpumagic.launch.plan import TORCHRUN_VARIABLES, LaunchPlan

# (keywords of the API, the same as %%launch_ddp's line, what the refusal says)
REFUSED = [
    ({"timeout": "8d"}, "--timeout 8d", "process group timeout: at most 7d"),
    ({"timeout": "0s"}, "--timeout 0s", "timeout must be more than 0 seconds"),
    ({"backend": "smoke"}, "--backend smoke", "unknown backend 'smoke'; use one of gloo, nccl, mpi, ucc"),
    ({"port": 70000}, "--port 70000", "port must be a whole number from 1 to 65535, got 70000"),
    ({"gpus_per_rank": 0}, "--gpus-per-rank 0", "gpus_per_rank must be a whole number of at least 1, got 0"),
    ({"nprocs": 0}, "-n 0", "the number of ranks must be a whole number from 1 to 256, got 0"),
    ({"nnodes": 0, "rdzv_endpoint": "127.0.0.1:0"}, "--nnodes 0 --rdzv-endpoint 127.0.0.1:0", "nnodes must be"),
    ({"nnodes": 2}, "--nnodes 2", "a multi-node launch needs --rdzv-endpoint HOST:PORT"),
    ({"rdzv_endpoint": "nowhere"}, "--rdzv-endpoint nowhere", "the rendezvous endpoint is HOST:PORT"),
    ({"max_restarts": -1}, "--max-restarts -1", "max_restarts must be a whole number from 0 to 100, got -1"),
    ({"rdzv_endpoint": "127.0.0.1:0", "rdzv_id": "a b"}, "--rdzv-endpoint 127.0.0.1:0 --rdzv-id 'a b'", "rdzv_id is"),
    ({"max_restarts": 1, "port": 5000}, "--max-restarts 1 --port 5000", "leave out --port"),
    (
        {"nnodes": 2, "rdzv_endpoint": "127.0.0.1:0", "node_rank": 2},
        "--nnodes 2 --rdzv-endpoint 127.0.0.1:0 --node-rank 2",
        "node_rank must be from 0 to 1, got 2",
    ),
    (
        {"nnodes": 2, "rdzv_endpoint": "127.0.0.1:0", "node_rank": 1},
        "--nnodes 2 --rdzv-endpoint 127.0.0.1:0 --node-rank 1",
        "node 0 serves the rendezvous: name its address and port in --rdzv-endpoint",
    ),
]


@pytest.mark.parametrize(("keywords", "line", "says"), REFUSED)
def test_a_bad_option_is_refused_in_the_same_line_by_the_value_the_api_check_launch_and_the_magic(
    shell, simulated, keywords, line, says
):
    keywords = {"nprocs": 1, "gpus": "none", **keywords}
    with pytest.raises(InvalidArgument) as made:
        LaunchOptions(**keywords)
    message = str(made.value)
    assert says in message and "\n" not in message
    nprocs = keywords.pop("nprocs")
    for refuse in (check_launch, lambda n, **k: gpumagic.launch_ddp(print, n, **k)):
        with pytest.raises(InvalidArgument) as caught:
            refuse(nprocs, **keywords)
        assert str(caught.value) == message
    for wait in ("", " --no-wait"):  # --no-wait checks before it starts a thread; a blocking launch as it starts
        with pytest.raises(UsageError) as magic:
            shell.run_cell_magic("launch_ddp", f"-n {nprocs} --gpus none {line}{wait} --no-dashboard", "rank")
        assert str(magic.value) == message


def test_options_the_api_does_not_know_or_spawn_cannot_honour_are_refused_the_same_way(simulated):
    with pytest.raises(InvalidArgument, match=r"^unknown launch option\(s\): bogus, process_group$"):
        check_launch(1, gpus="none", bogus=1, process_group=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):  # its signature names every option
        gpumagic.launch_ddp(print, 1, gpus="none", bogus=1)
    with pytest.raises(InvalidArgument, match="spawn runs on this machine only"):
        gpumagic.spawn(print, nprocs=1, gpus="none", max_restarts=1)


def test_what_follows_from_the_options():
    local = LaunchOptions(2, timeout="1m")
    assert local.timeout_s == 60.0 and not local.elastic and local.endpoint == "127.0.0.1:0"
    elastic = LaunchOptions(1, max_restarts=2)
    assert elastic.elastic and elastic.rendezvous_address() == ("127.0.0.1", 0) and elastic.hosts_rendezvous
    nodes = LaunchOptions(1, nnodes=2, rdzv_endpoint="[::1]:29400", node_rank=1)
    assert nodes.rendezvous_address() == ("::1", 29400) and not nodes.hosts_rendezvous
    assert LaunchOptions.of(3, {"output": "rank0"}) == LaunchOptions(3, output="rank0")


def test_a_group_takes_its_own_default_output_and_what_rank_group_takes():
    group = LaunchOptions.for_group(2, gpus="none", timeout=30)
    assert (group.nprocs, group.gpus, group.gpus_per_rank, group.backend, group.timeout_s, group.output) == (
        2,
        "none",
        1,
        None,
        30.0,
        "rank0",
    )
    with pytest.raises(InvalidArgument, match="output must be one of all, rank0, none, got 'loud'"):
        LaunchOptions.for_group(output="loud")
    with pytest.raises(InvalidArgument, match="a group of ranks does not take port; it takes nprocs"):
        LaunchOptions.for_group(port=5000)  # RankGroup takes no port


def test_a_job_request_checks_its_ranks_in_its_own_words_and_the_rest_as_a_launch():
    assert JobRequest.of(ddp=2, timeout="1m").launch.timeout_s == 60.0 and JobRequest.of(ddp=2).ddp == 2
    with pytest.raises(InvalidArgument, match="ddp is the number of ranks, a whole number from 1 to 256, got 0"):
        JobRequest.of(ddp=0)
    with pytest.raises(InvalidArgument, match="unknown backend"):
        JobRequest.of(ddp=2, backend="carrier-pigeon")
    with pytest.raises(InvalidArgument, match="give min_free too"):
        JobRequest.of(memory_limit=True)


def test_the_handle_gives_the_results_and_tells_on_end_first():
    told = []
    release = threading.Event()

    def run():
        release.wait(10)
        return {0: "a", 1: "b"}

    handle = LaunchHandle(run, on_end=told.append).start()
    assert handle.join(0.05) is None and not handle.done()
    release.set()
    assert handle.join(10) == {0: "a", 1: "b"} and told == [{0: "a", 1: "b"}] and handle.done()


@pytest.mark.parametrize("error", [ValueError("bad batch"), KeyboardInterrupt(), SystemExit(3)])
def test_every_error_of_a_background_launch_reaches_on_end_and_join(error):
    """The --no-wait thread caught only Exception: a launch ending otherwise left -o VAR unset for good."""
    told = []

    def run():
        raise error

    handle = LaunchHandle(run, on_end=told.append).start()
    with pytest.raises(type(error)):
        handle.join(10)
    assert told == [error]


@pytest.mark.parametrize("outcome", [{0: 1, 1: 1}, SystemExit(3)])
def test_launch_ddp_without_waiting_sets_its_variable_through_the_shared_handle(shell, monkeypatch, outcome):
    import gpumagic.launch.kernel_side.ddp as launch_api

    def launch(packed, launch, dashboard=None):
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(launch_api, "launch_packed", launch)  # what launch_sharing runs on the launch's thread
    shell.user_ns.pop("later", None)
    shell.run_cell_magic("launch_ddp", "-n 2 --gpus none --no-wait --no-dashboard -o later", "rank")
    handle = SESSION.last_launch
    assert isinstance(handle, LaunchHandle)
    with pytest.raises(SystemExit) if isinstance(outcome, BaseException) else contextlib.nullcontext():
        handle.join(10)
    assert shell.user_ns["later"] is outcome


def test_local_ranks_and_slurm_tasks_get_the_torchrun_variables_from_one_writer():
    plan = LaunchPlan("/runs/run-7", 2, 29500, "gloo", ((), ()), False, 1, 60.0, 1, base_env={})
    local = plan.environment(1)
    assert {name: local[name] for name in TORCHRUN_VARIABLES} == {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0",
        "NODE_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "run-7",
    }
    task = torchrun_environment("4242", 3, 1, 4, 2, 1, "node-a")
    assert list(task) == list(TORCHRUN_VARIABLES)
    assert (task["RANK"], task["LOCAL_WORLD_SIZE"], task["GROUP_RANK"], task["NODE_RANK"]) == ("3", "2", "1", "1")
    assert task["MASTER_ADDR"] == "node-a" and task["TORCHELASTIC_RUN_ID"] == "4242"


def test_a_group_refuses_options_it_would_ignore():
    for launch in (
        LaunchOptions(2, port=5000),
        LaunchOptions(2, start_method="spawn"),
        LaunchOptions(2, max_restarts=1),
    ):
        with pytest.raises(InvalidArgument, match="a group of ranks runs on this machine"):
            RankGroup(launch)
    with pytest.raises(InvalidArgument, match="a group of ranks does not take max_restarts"):
        LaunchOptions.for_group(2, max_restarts=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_restarts'"):  # not in its signature
        gpumagic.ranks(2, max_restarts=1)


def test_a_group_across_several_nodes_outside_an_allocation_says_where_it_runs(shell, monkeypatch):
    """#41: %ddp start --nnodes N runs on the nodes of the kernel's Slurm allocation; outside one it is refused
    in one line saying how to get one (tests/kernel/test_slurm_group.py runs it inside one)."""
    from IPython.core.error import UsageError

    for name in ("SLURM_JOB_ID", "SLURM_JOBID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UsageError) as caught:
        shell.run_line_magic("ddp", "start -n 1 --nnodes 2 --gpus none")
    assert "nodes of a Slurm allocation" in str(caught.value) and "salloc -N 2" in str(caught.value)
    assert "\n" not in str(caught.value)
    with pytest.raises(InvalidArgument, match="runs on the nodes of a Slurm allocation"):
        gpumagic.ranks(2, nnodes=2)
