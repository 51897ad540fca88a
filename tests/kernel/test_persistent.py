"""Persistent ranks (``%ddp``/``%%ddp``, ``gpumagic.ranks``) in a real kernel, on CPU ranks with gloo."""

import os
import signal
import time

import psutil
import pytest
from conftest import cpu_kernel

from tests.kernel.test_launch import alive, rank_processes

pytestmark = pytest.mark.kernel

# The group's grace period: long enough that what follows one (re-forming the group: 1.8 s seen under load) ends before
# a second would, so "one grace period" and "no grace period" read from the clock on a busy machine
GRACE_S = 4.0
TRAIN = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=lr)
torch.manual_seed(1 + rank)
x, y = torch.randn(64, 8), torch.randn(64, 1)
steps = 0
gpumagic.keep(model, optimizer)
"""
STEP = """
for _ in range(n):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    steps += 1
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.zeros_like(weights) for _ in range(world_size)]
dist.all_gather(gathered, weights)
(steps, round(loss.item(), 6), all(torch.equal(gathered[0], g) for g in gathered))
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    with cpu_kernel(tmp_path_factory, "%load_ext gpumagic\nimport gpumagic, os") as k:
        k.pid_ = int(k.ok("print(os.getpid())").stdout)
        yield k


@pytest.fixture
def group(kernel):
    """A started group of 2 CPU ranks; stopped after the test, leaving no rank behind."""
    kernel.ok(f"%ddp start -n 2 --grace {GRACE_S}s --no-dashboard")
    yield kernel
    kernel.ok("%ddp stop")
    deadline = time.time() + 5
    while rank_processes(kernel.pid_) and time.time() < deadline:
        time.sleep(0.1)
    assert rank_processes(kernel.pid_) == [], "ranks outlived %ddp stop"


def rank_pids(kernel) -> list[int]:
    return [int(p) for p in kernel.ok("print(*gpumagic.ddp_group().pids)").stdout.split()]


def interrupt_after(kernel, cell: str, wait_s: float) -> tuple[dict, float]:
    """Run ``cell``, interrupt the kernel after ``wait_s`` seconds; the reply and how long the cell took to end."""
    kernel.client.execute(cell)
    time.sleep(wait_s)
    return kernel.interrupt()


def test_state_is_kept_across_three_cells_with_identical_replicas(group):
    group.ok("lr = 0.05")
    group.ok("%%ddp\n" + TRAIN)
    group.ok("n = 5")
    group.ok("%%ddp -o second\n" + STEP)
    group.ok("%%ddp -o third\n" + STEP)
    second, third = group.ok("print(second)\nprint(third)").stdout.strip().splitlines()
    second, third = eval(second), eval(third)
    assert [v[0] for v in second.values()] == [5, 5] and [v[0] for v in third.values()] == [10, 10]
    assert all(v[2] for v in (*second.values(), *third.values()))  # every rank holds the same weights
    # the model trained on: cell 3's loss continues below cell 2's on every rank
    assert all(third[r][1] < second[r][1] for r in (0, 1))


def test_kernel_names_travel_once_and_the_ranks_own_names_never(group):
    group.ok("import torch\nbig = torch.arange(1000.0)\nlr = 0.1\nmodel = 'the kernel has its own model'")
    group.ok("%%ddp\nmodel = torch.nn.Linear(2, 2)\nfirst = id(big)")
    out = group.ok("%%ddp -o seen\n(id(big) == first, type(model).__name__, lr)")
    assert "{0: (True, 'Linear', 0.1), 1: (True, 'Linear', 0.1)}" in group.ok("print(seen)").stdout
    group.ok("lr = 0.01\nbig[0] = -1.0")  # changed in the kernel: sent again
    group.ok("%%ddp -o seen\n(id(big) == first, big[0].item(), lr)")
    assert group.ok("print(seen)").stdout.strip() == "{0: (False, -1.0, 0.01), 1: (False, -1.0, 0.01)}"
    assert "(same on rank 1)" not in out.stdout  # nothing printed


def test_pull_and_push_a_state_dict(group):
    group.ok("%%ddp\nimport torch\ntorch.manual_seed(rank)\nnet = torch.nn.Linear(3, 1)\n")
    out = group.ok(
        "g = gpumagic.ddp_group()\n"
        "state = g.pull('net', rank=1).state_dict()\n"
        "print(type(state).__name__, sorted(state), state['weight'].device)"
    ).stdout
    assert out.strip() == "OrderedDict ['bias', 'weight'] cpu"
    out = group.ok(
        "state = {k: v * 0 + 7 for k, v in g.pull('net').state_dict().items()}\n"
        "g.push(new_state=state)\n"
        "print(g.exec('net.load_state_dict(new_state); float(net.weight.detach().sum() + net.bias.detach().sum())'))"
    ).stdout
    assert out.strip() == "{0: 28.0, 1: 28.0}"
    error = group.run("g.pull('no_such_name')").error
    assert error is not None and "name 'no_such_name' is not defined on rank 0" in error[1]


def test_output_shows_rank_0_and_says_when_the_others_printed_the_same(group):
    out = group.ok("%%ddp\nprint('same everywhere')\nprint('from', rank)").stdout
    assert "[rank 0] same everywhere" in out and "[rank 0] from 0" in out
    assert "[rank 1] from 1" in out and "[rank 1] same everywhere" not in out
    out = group.ok("%%ddp\nprint('hello')").stdout
    assert out.strip().endswith("[rank 0] hello\n(same on rank 1)".strip())
    out = group.ok("%%ddp --output all\nprint('hello')").stdout
    assert "[rank 1] hello" in out
    out = group.ok("%%ddp --ranks 1 -o only\nprint('just me', rank)\nrank").stdout
    assert "[rank 1] just me 1" in out and group.ok("print(only)").stdout.strip() == "{1: 1}"


def test_a_failing_rank_shows_its_traceback_and_the_group_goes_on(group):
    result = group.run("%%ddp\nx = 1\nif rank == 1:\n    raise ValueError('bad batch')\ndist.barrier()")
    assert result.error[0] == "CellFailed" and "rank 1 failed: raised ValueError: bad batch" in result.error[1]
    assert "raise ValueError('bad batch')" in result.error[1]
    group.ok("%%ddp -o ok\nimport torch\nt = torch.ones(1)\ndist.all_reduce(t)\n(t.item(), x)")
    assert group.ok("print(ok)").stdout.strip() == "{0: (2.0, 1), 1: (2.0, 1)}"


def test_interrupt_during_a_compute_loop_keeps_the_namespaces(group):
    group.ok("%%ddp\nimport time, torch\nkept = rank + 100\nsteps = 0")
    reply, took = interrupt_after(group, "%%ddp\nwhile True:\n    steps += 1\n    time.sleep(0.01)", 1.5)
    assert reply["status"] == "error" and reply["ename"] == "CellInterrupted", reply
    assert took < GRACE_S, f"the cell took {took:.1f}s to stop (it waited a grace period of {GRACE_S}s)"
    group.ok("%%ddp -o after\nt = torch.ones(1)\ndist.all_reduce(t)\n(t.item(), kept, steps > 10)")
    assert group.ok("print(after)").stdout.strip() == "{0: (2.0, 100, True), 1: (2.0, 101, True)}"


def test_interrupt_of_a_collective_one_rank_skipped_reforms_the_group(group):
    group.ok("%%ddp\nimport torch\nkept = rank + 100")
    cell = "%%ddp\nif rank == 0:\n    dist.all_reduce(torch.ones(1))\n'done'"
    reply, took = interrupt_after(group, cell, 1.5)
    assert reply["ename"] == "CellInterrupted" and "re-formed on a fresh rendezvous" in reply["evalue"], reply
    assert took < 2 * GRACE_S, f"the cell took {took:.1f}s to return (grace {GRACE_S}s: one, then re-forming)"
    group.ok("%%ddp -o after\nt = torch.ones(1)\ndist.all_reduce(t)\n(t.item(), kept)")
    assert group.ok("print(after)").stdout.strip() == "{0: (2.0, 100), 1: (2.0, 101)}"


def test_a_rank_that_will_not_stop_is_killed_replaced_and_its_losses_named(group):
    group.ok("%%ddp\nimport signal, torch\nscratch = rank + 100")
    before = rank_pids(group)
    cell = "%%ddp\nif rank == 1:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n    while True:\n        pass\n'x'"
    reply, took = interrupt_after(group, cell, 1.0)
    assert reply["ename"] == "CellInterrupted", reply
    message = reply["evalue"]
    assert "rank 1 did not stop and was killed" in message and "replaced by a fresh rank" in message, message
    assert "lost on rank 1: scratch" in message
    assert took < 2 * GRACE_S + 5.0
    after = rank_pids(group)
    assert after[0] == before[0] and after[1] != before[1] and not alive(before[1])
    group.ok("%%ddp -o now\nt = torch.ones(1)\ndist.all_reduce(t)\n(t.item(), 'scratch' in globals())")
    assert group.ok("print(now)").stdout.strip() == "{0: (2.0, True), 1: (2.0, False)}"


def test_a_cell_timeout_stops_it_like_an_interrupt(group):
    started = time.monotonic()
    result = group.run("%%ddp --timeout 1s\nimport torch\nif rank == 1:\n    dist.barrier()\n'done'")
    took = time.monotonic() - started
    assert result.error[0] == "CellInterrupted" and "timed out" in result.error[1]
    assert took < 1.0 + 2 * GRACE_S + 2.0
    group.ok("%%ddp -o after\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()")
    assert group.ok("print(after)").stdout.strip() == "{0: 2.0, 1: 2.0}"
    error = group.run("%%ddp --timeout soon\npass").error
    assert error[0] == "UsageError"


def test_a_killed_rank_is_replaced_with_its_kept_state_and_its_losses_listed(group):
    group.ok("lr = 0.05\nn = 3")
    group.ok("%%ddp\n" + TRAIN + "\nscratch = [rank]")
    group.ok("%%ddp\n" + STEP)
    before = rank_pids(group)
    result = group.run("%%ddp\nimport signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\ndist.barrier()")
    assert result.error[0] == "CellFailed"
    message = result.error[1]
    assert "rank 1 failed: killed by SIGKILL" in message
    assert "rank 1 was killed by SIGKILL" in message and "replaced by a fresh rank" in message
    assert "restored on rank 1: model, optimizer (gpumagic.keep) from rank 0" in message
    assert "DDP, torch (its cells' imports and definitions, run again)" in message
    assert "lr, n (sent from the notebook)" in message
    lost = message.split("lost on rank 1: ")[1].split("\n")[0].split(", ")
    assert {"scratch", "steps"} <= set(lost) and "torch" not in lost and "DDP" not in lost, message
    after = rank_pids(group)
    assert after[0] == before[0] and after[1] != before[1] and not alive(before[1])
    # the fresh rank trains on with the kept model and optimizer: replicas identical again
    group.ok("%%ddp -o again\nx, y = torch.randn(64, 8), torch.randn(64, 1)\nsteps = 0\n" + STEP)
    again = eval(group.ok("print(again)").stdout)
    assert again[0][2] and again[1][2]
    assert group.ok("%ddp kept").text[0] == "kept (restored on a replaced rank): model, optimizer"


def test_status_shows_a_rank_busy_in_a_collective(kernel):
    kernel.ok(
        "import threading, time\n"
        "g = gpumagic.ranks(2, output='none', grace=1)\n"
        "g.exec('import torch')\n"
        'worker = threading.Thread(target=lambda: g.exec("if rank == 0:\\n    dist.all_reduce(torch.ones(1))", '
        "namespace={}, timeout=3), daemon=True)\n"
        "worker.start()\ntime.sleep(1.0)\nrows = g.status()\n"
        "print(rows[0]['cell'], rows[0]['collective'][0], rows[1]['cell'], rows[0]['alive'])"
    )
    out = kernel.ok("print(rows[0]['cell'], rows[0]['collective'][0], rows[1]['cell'], rows[0]['alive'])").stdout
    assert out.split() == ["<ddp", "cell", "2>", "all_reduce", "None", "True"]
    kernel.ok("worker.join(30)\nprint(g.exec('rank'))\ng.close()")


def test_magics_refuse_bad_input_in_one_line(kernel):
    for line, expected in [
        ("%ddp start -n 0", "the number of ranks must be a whole number from 1"),
        ("%ddp start --backend smoke", "unknown backend 'smoke'"),
        ("%ddp start --timeout never", "'never' is not a duration"),
        ("%ddp frobnicate", "%ddp has no subcommand 'frobnicate'"),
        ("%ddp free", "no group is running"),
        ("%%ddp --ranks x\npass", "--ranks takes rank numbers"),
        ("%%ddp -o 1x\npass", "-o needs a variable name"),
        ("%ddp sync --from x", "invalid int value"),
    ]:
        result = kernel.run(line)
        assert result.error is not None and result.error[0] == "UsageError", (line, result.error)
        assert expected in result.error[1] and "\n" not in result.error[1], (line, result.error)
    assert "no group is running" in kernel.ok("%ddp status").all_text
    assert "%ddp start" in kernel.ok("%ddp --help").all_text


def test_a_ddp_cell_with_no_group_starts_one_and_says_so(kernel):
    out = kernel.ok("%%ddp -o ranks_seen\nimport os\n(rank, world_size, os.environ['RANK'])").stdout
    assert "no group was running: starting one with the defaults" in out and "2 ranks ready (gloo, CPU)" in out
    assert kernel.ok("print(ranks_seen)").stdout.strip() == "{0: (0, 2, '0'), 1: (1, 2, '1')}"
    status = kernel.ok("%ddp status").all_text
    assert "2 ranks (gloo)" in status and status.count("idle") == 2
    error = kernel.run("%%ddp --ranks 5\npass").error
    assert error[0] == "UsageError" and "ranks must be among 0..1" in error[1]
    error = kernel.run("%%ddp --ranks 0,0\npass").error
    assert error[0] == "UsageError" and "[0, 0] names a rank twice" in error[1]
    assert "objects collected" in kernel.ok("%ddp free").all_text
    kernel.ok("%ddp restart --help")
    out = kernel.ok("%ddp restart").stdout
    assert "stopped 2 ranks" in out and "2 ranks ready" in out
    kernel.ok("%ddp stop")
    assert "no group is running" in kernel.ok("%ddp stop").stdout


def test_kernel_death_leaves_no_rank_and_no_rank_child(start_kernel, tmp_path):
    victim = start_kernel(CUDA_VISIBLE_DEVICES="")
    victim.ok("%load_ext gpumagic\n%ddp start -n 2 --no-dashboard")
    children = tmp_path / "children"
    victim.ok(
        f"%%ddp\nimport os, subprocess\nchild = subprocess.Popen(['sleep', '300'])\n"
        f"with open({str(children)!r}, 'a') as f:\n    f.write(f'{{os.getpid()}} {{child.pid}}\\n')"
    )
    pids = [int(p) for p in children.read_text().split()]
    assert len(pids) == 4 and all(alive(p) for p in pids)
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    while any(alive(p) for p in pids) and time.monotonic() - killed < 10:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], "ranks or their children outlived their kernel"
    assert time.monotonic() - killed < 5
    later = start_kernel(CUDA_VISIBLE_DEVICES="")
    out = later.ok(
        "import gpumagic\n"
        f"print([r.status for r in gpumagic.runs() if r.info['kind'] == 'ddp-group' and r.info['pid'] == {victim.pid}])"
    ).stdout
    assert out.strip() == "['lost']"  # the group's run ended with its kernel


def test_a_hundred_cells_leak_no_descriptors_threads_widgets_or_memory(group):
    group.ok("%%ddp\nimport torch\nx = 0")
    kernel_process = psutil.Process(group.pid_)
    counts = "import ipywidgets\nprint(len(ipywidgets.Widget.widgets), len(get_ipython().kernel.comm_manager.comms))"
    group.ok("%%ddp\nx += 1\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(x)")
    before = (kernel_process.num_fds(), kernel_process.num_threads(), group.ok(counts).stdout)
    memory_before = kernel_process.memory_info().rss
    for _ in range(100):
        group.ok("%%ddp\nx += 1\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(x)")
    after = (kernel_process.num_fds(), kernel_process.num_threads(), group.ok(counts).stdout)
    grown = (kernel_process.memory_info().rss - memory_before) / 2**20
    # no growth; fewer descriptors is no leak (1 run in 3, before issue #24 too, the last test's leftovers close
    # during these cells: 80 -> 77)
    assert after[0] <= before[0] and after[1:] == before[1:], (before, after)
    assert grown < 10, f"the kernel grew {grown:.1f} MiB over 100 cells"
    assert group.ok("%%ddp -o x_now\nx").stdout == "" and "{0: 101, 1: 101}" in group.ok("print(x_now)").stdout


def test_a_kernel_that_used_torch_threads_can_start_a_group(start_kernel):
    k = start_kernel(CUDA_VISIBLE_DEVICES="")
    k.ok("import torch\ntorch.set_num_threads(2)\n(torch.ones(512, 512) @ torch.ones(512, 512)).sum()")
    k.ok("%load_ext gpumagic\nimport gpumagic\nwith gpumagic.ranks(2) as g:\n    out = g.exec('rank * 3')")
    assert k.ok("print(out)").stdout.strip() == "{0: 0, 1: 3}"


def test_one_dashboard_per_group_follows_its_curves_across_cells(kernel):
    kernel.ok("%ddp start -n 2")
    board = "gpumagic.launch.kernel_side.session.SESSION.group_dashboard"
    prompts = [
        kernel.ok("%%ddp\nfor step in range(5):\n    gpumagic.log(loss=1.0 / (step + 1))").execution_count
        for _ in range(2)
    ]
    out = kernel.ok(
        f"import time\nd = {board}\ndeadline = time.time() + 10\n"
        "while d.points < 20 and time.time() < deadline:\n    time.sleep(0.2)\n"
        "print(d.title, d.points, d.state)"
    ).stdout
    assert out.split() == ["%ddp", "group", "20", "running"]  # 2 cells x 5 steps x 2 ranks, in one dashboard
    marks = kernel.ok(
        "drawn = [list(r.data_source.data['step']) for r in d.metric_figures['loss'][0].renderers"
        " if r.data_source is d.marks]\n"
        "print([step for _, step in d.cell_marks], drawn)"
    ).stdout
    assert marks.strip() == "[0, 4.0] [[0, 4.0]]"  # each cell marked at the last step before it, on the loss plot
    labels = kernel.ok("print(*[label for label, _ in d.cell_marks])").stdout.split()
    assert labels == [f"In[{number}]" for number in prompts]  # named as their prompts show them
    kernel.ok("%ddp watch")
    assert kernel.ok(f"print(d is not {board}, d.state)").stdout.split() == ["True", "superseded"]
    kernel.ok("%ddp stop")
    assert kernel.ok(f"print({board}, d.state)").stdout.split() == ["None", "superseded"]
    assert kernel.ok("print(d.snapshot.count('Bokeh.embed.embed_items'))").stdout.strip() == "1"  # its picture


def test_a_group_holds_the_gpus_it_leased_until_it_stops(start_kernel):
    k = start_kernel(GPUMAGIC_SIMULATE="4xA100-80GB")
    k.ok("%load_ext gpumagic\nimport gpumagic")
    out = k.ok("%ddp start -n 2 --gpus auto --no-dashboard").stdout
    assert "2 ranks ready (gloo, CPU)" in out  # simulated GPUs: the ranks run on the CPU, each with its GPU
    assert repr(k.ok("%gpu").text).count("leased by this kernel") == 2
    k.ok("%%ddp -o seen\nimport os\nos.environ['CUDA_VISIBLE_DEVICES']")
    seen = k.ok("print(len(set(seen.values())), all(v.startswith('GPU-') for v in seen.values()))").stdout
    assert seen.split() == ["2", "True"]
    k.ok("%ddp stop")
    assert repr(k.ok("%gpu").text).count("leased by this kernel") == 0


def test_re_forming_the_group_releases_the_old_one(kernel):
    out = kernel.ok(
        "import psutil\n"
        "g = gpumagic.ranks(2, output='none', grace=0.5)\n"
        "g.exec('import torch\\nt = torch.ones(1)\\ndist.all_reduce(t)', namespace={})\n"
        "def counts():\n"
        "    return [(psutil.Process(p).num_threads(), psutil.Process(p).num_fds()) for p in g.pids]\n"
        "before = counts()\n"
        "for _ in range(5):\n"
        "    try:\n"
        "        g.exec('if rank == 0:\\n    dist.all_reduce(torch.ones(1))', namespace={}, timeout=0.2)\n"
        "    except gpumagic.CellInterrupted:\n"
        "        pass\n"
        "    g.exec('t = torch.ones(1)\\ndist.all_reduce(t)', namespace={})\n"
        "after = counts()\n"
        "g.close()\n"
        "print(g.reformed, after == before, before, after)"
    ).stdout
    assert out.split()[:2] == ["5", "True"], out  # every rank's threads and descriptors as before 5 re-forms


def test_a_rank_slow_to_leave_a_broken_group_keeps_its_namespace_whatever_the_grace(kernel):
    # Leaving collects garbage: a namespace whose collection takes longer than a short grace period (big object
    # graphs do) was killed and replaced, losing every name, though nothing in it was stuck.
    out = kernel.ok(
        "g = gpumagic.ranks(2, output='none', grace=0.5)\n"
        "g.exec('import gc, time, torch\\nclass Slow:\\n    def __del__(self):\\n        time.sleep(1.5)\\n'\n"
        "       'if rank == 1:\\n    gc.disable()\\n    junk = Slow()\\n    junk.cycle = junk\\n    del junk\\n'\n"
        "       'kept = rank + 100', namespace={})\n"
        "before = g.pids\n"
        "try:\n"
        "    g.exec('if rank == 0:\\n    dist.all_reduce(torch.ones(1))', namespace={}, timeout=0.2)\n"
        "except gpumagic.CellInterrupted as interrupted:\n"
        "    message = str(interrupted)\n"
        "kept = g.exec('kept', namespace={})\n"
        "print(g.pids == before, kept, repr(message))\n"
        "g.close()"
    ).stdout
    assert out.startswith("True {0: 100, 1: 101} "), out
    assert "could not leave" not in out and "re-formed on a fresh rendezvous" in out, out


def test_ranks_out_of_step_after_a_cell_get_a_fresh_group(group):
    # an asynchronous all_reduce returns at once (as NCCL's collectives do): rank 1 never called it
    out = group.ok(
        "%%ddp\nimport torch\nt = torch.ones(1)\nif rank == 0:\n    work = dist.all_reduce(t, async_op=True)"
    ).stdout
    assert "the ranks made different numbers of collectives (rank 0: 1, rank 1: 0)" in out
    assert "re-formed on a fresh rendezvous" in out
    group.ok("%%ddp -o after\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()")
    assert group.ok("print(after)").stdout.strip() == "{0: 2.0, 1: 2.0}"


def test_the_python_api_runs_functions_in_the_ranks_namespaces(kernel):
    out = kernel.ok(
        "lr = 0.5\n"
        "with gpumagic.ranks(2, output='none') as g:\n"
        "    g.exec('a = lr * 2')\n"
        "    def step(x):\n"
        "        return x + a + rank\n"
        "    ran = g.run(step, 1)\n"
        "    g.push(a=10.0)\n"
        "    pushed = g.run(step, 1)\n"
        "print(ran, pushed, g.closed)"
    ).stdout
    assert out.strip() == "{0: 2.0, 1: 3.0} {0: 11.0, 1: 12.0} True"
    error = kernel.run("g.exec('1')").error
    assert error[0] == "GroupError" and "this group of ranks is closed" in error[1]


# --- a day of real work (issue 25) ---------------------------------------------------------------------------

LOOP = """
while True:
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    steps += 1
"""
REPLICAS = """
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
(steps, weights.sum().item(), weights.abs().sum().item())
"""


def test_an_interrupted_ddp_loop_stops_every_rank_at_the_same_step(group):
    group.ok("lr = 0.01")
    group.ok("%%ddp\n" + TRAIN)
    for wait_s in (1.0, 1.4):  # wherever the interrupt lands in a step
        reply, took = interrupt_after(group, "%%ddp\n" + LOOP, wait_s)
        assert reply["ename"] == "CellInterrupted", reply
        message = reply["evalue"]
        assert "every rank stopped before the same collective or DDP forward" in message, message
        assert "the replicas are alike: model, optimizer, steps" in message, message
        assert "re-formed" not in message and took < GRACE_S, (took, message)
        group.ok("%%ddp -o now\n" + REPLICAS)
        now = eval(group.ok("print(now)").stdout)
        assert now[0] == now[1] and now[0][0] > 0, now  # one step count, one set of weights


def test_replicas_that_differ_are_named_and_made_alike_again(group):
    group.ok("lr = 0.05")
    group.ok("%%ddp\n" + TRAIN)
    group.ok("%%ddp\n" + STEP.replace("for _ in range(n)", "for _ in range(2)"))
    assert group.ok("%ddp check").text[0] == "the replicas are alike: model, optimizer, steps"
    # rank 1 takes a step of its own (outside DDP): its weights and its counter move apart
    group.ok("%%ddp\nif rank == 1:\n    with torch.no_grad():\n        model.module.weight += 0.5\n    steps += 1")
    report = group.ok("%ddp check").text[0]
    assert report.startswith("the replicas differ: model (rank 1 differs); steps (rank 0: 2, rank 1: 3)"), report
    assert "%ddp sync makes every rank like rank 0" in report
    assert group.ok("%ddp sync").text[0] == "every rank now has rank 0's model, optimizer, steps"
    group.ok("%%ddp -o now\n" + REPLICAS)
    now = eval(group.ok("print(now)").stdout)
    assert now[0] == now[1] and now[0][0] == 2, now
    assert group.ok("%ddp check").text[0] == "the replicas are alike: model, optimizer, steps"
    error = group.run("%ddp sync no_such_name").error
    assert error[0] == "UsageError" and "'no_such_name' is not defined on rank 0" in error[1]


def test_an_interrupt_that_cannot_stop_the_ranks_together_says_which_replicas_differ(group):
    # no collective and no DDP forward to stop at: interrupted wherever each rank is, at its own count
    group.ok("%%ddp\nimport time\nsteps = 0")
    reply, _ = interrupt_after(group, "%%ddp\nwhile True:\n    steps += 1\n    time.sleep(0.002 * (rank + 1))", 1.0)
    message = reply["evalue"]
    assert "the replicas differ now: steps (rank 0: " in message, message
    assert "%ddp sync makes every rank like rank 0" in message


def test_an_interrupt_with_a_rank_waiting_for_a_peer_that_is_not_coming_takes_one_grace_period(group):
    # both ranks made sync points in this cell, but rank 1 waits in a barrier that rank 0 will not reach soon:
    # no point to stop at together, so the usual interrupt, then the group is broken after one grace period
    cell = "%%ddp\nimport time\ndist.barrier()\nif rank == 0:\n    time.sleep(60)\nelse:\n    dist.barrier()"
    reply, took = interrupt_after(group, cell, 1.5)
    assert reply["ename"] == "CellInterrupted" and "re-formed on a fresh rendezvous" in reply["evalue"], reply
    assert took < 2 * GRACE_S, f"the cell took {took:.1f}s to return (grace {GRACE_S}s: one, then re-forming)"


def test_a_rank_failing_in_backward_frees_its_peers_at_once(group):
    group.ok("lr = 0.05")
    group.ok("%%ddp\n" + TRAIN)
    hook = (
        "def bad_gradient(gradient):\n"
        "    if rank == 1:\n"
        "        raise ValueError('bad gradient on rank 1')\n"
        "    return gradient\n"
        "handle = model.module.weight.register_hook(bad_gradient)\n"
    )
    started = time.monotonic()
    result = group.run("%%ddp\n" + hook + "torch.nn.functional.mse_loss(model(x), y).backward()")
    took = time.monotonic() - started
    assert (
        result.error[0] == "CellFailed"
        and "rank 1 failed: raised ValueError: bad gradient on rank 1" in result.error[1]
    )
    rank_0 = result.error[1].split("  rank 0: ")[1].split("\n")[0]
    assert "stopped by gpumagic after the failure" in rank_0 or "after rank 1 failed" in rank_0, rank_0
    assert took < GRACE_S, f"rank 0 waited {took:.1f}s for its failed peer (grace {GRACE_S}s)"
    group.ok("%%ddp -o after\nhandle.remove()\n" + STEP.replace("for _ in range(n)", "for _ in range(2)"))
    after = eval(group.ok("print(after)").stdout)
    assert after[0][2] and after[1][2]  # DDP trains on, on a re-formed group, replicas identical


DATA = """
import torch
from torch.utils.data import DataLoader, Dataset
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

class Samples(Dataset):
    def __len__(self):
        return 400

    def __getitem__(self, i):
        if rank == 1 and i == bad_index:
            raise ValueError(f"sample {i} is corrupt")
        return torch.randn(8), torch.randn(1)

def train():
    steps = 0
    for x, y in DataLoader(Samples(), batch_size=8, num_workers=2):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        steps += 1
    return steps
"""


def test_a_data_loader_worker_error_costs_no_grace_and_no_rank(group):
    group.ok("bad_index = 100")
    group.ok("%%ddp\n" + DATA)
    pids = rank_pids(group)
    started = time.monotonic()
    result = group.run("%%ddp\ntrain()")
    took = time.monotonic() - started
    assert result.error[0] == "CellFailed" and "sample 100 is corrupt" in result.error[1]
    assert "killed" not in result.error[1] and "replaced" not in result.error[1], result.error[1]
    assert took < GRACE_S, f"the failure took {took:.1f}s to report (it waited a grace period of {GRACE_S}s)"
    assert rank_pids(group) == pids  # no rank was lost
    group.ok("bad_index = -1")
    group.ok("%%ddp -o steps\ntrain()")
    assert group.ok("print(steps)").stdout.strip() == "{0: 50, 1: 50}"


def test_a_replaced_rank_gets_back_the_notebooks_names_imports_and_definitions(group):
    group.ok("scale = 3\ndef notebook_helper(v):\n    return v * scale + made_on_rank")
    group.ok(
        "%%ddp\nimport math\nfrom math import sqrt as root\nfrom collections import OrderedDict\n"
        "made_on_rank = 100 * rank\n"
        "class Doubler:\n    def __call__(self, v):\n        return 2 * v\n"
        "@staticmethod\ndef unused():\n    pass\n"
        "def cell_function(v):\n    return Doubler()(root(v)) + math.floor(0.5)\n"
        "gpumagic.keep(made_on_rank=made_on_rank)\n"
        "notebook_helper(1)"
    )
    result = group.run("%%ddp\nimport signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\ndist.barrier()")
    message = result.error[1]
    assert "restored on rank 1: made_on_rank (gpumagic.keep) from rank 0" in message, message
    assert "Doubler, OrderedDict, cell_function, math, root, unused (its cells' imports and definitions" in message
    assert "notebook_helper (sent from the notebook)" in message, message
    assert "lost on rank 1" not in message and "could not define" not in message, message
    out = group.ok("%%ddp -o seen\n(cell_function(16.0), notebook_helper(1), type(OrderedDict()).__name__)")
    # the fresh rank's kept made_on_rank is rank 0's (kept state is copied from a healthy rank)
    assert group.ok("print(seen)").stdout.strip() == "{0: (8.0, 3, 'OrderedDict'), 1: (8.0, 3, 'OrderedDict')}", out


def test_notebook_functions_see_the_ranks_names_and_travel_only_when_changed(group):
    group.ok(
        "import gpumagic.launch.kernel_side.group_shipping as persistent\n"
        "pickled = []\n"
        "original_digest = persistent._digest\n"
        "def counting_digest(name, value, shared=None):\n"
        "    pickled.append(name)\n"
        "    return original_digest(name, value, shared)\n"
        "persistent._digest = counting_digest\n"
        "offset = 10\n"
        "class Base:\n    def shift(self):\n        return offset\n"
        + "".join(f"class Layer{i}(Base):\n    def size(self):\n        return {i} + on_rank\n" for i in range(7))
        + "def total():\n    return sum(c().size() + c().shift() for c in LAYERS)\n"
    )
    uses = "LAYERS = (" + ", ".join(f"Layer{i}" for i in range(7)) + ")\n"
    try:
        group.ok("%%ddp\non_rank = rank")
        group.ok("%%ddp -o first\n" + uses + "total()")
        assert group.ok("print(first)").stdout.strip() == "{0: 91, 1: 98}"  # 21 + 7 * (rank + 10)
        group.ok("pickled.clear()")
        for _ in range(3):
            group.ok("%%ddp -o again\n" + uses + "total()")
        assert group.ok("print(pickled)").stdout.strip() == "[]"  # unchanged: not pickled, not sent again
        group.ok("offset = 20\nLayer3.size = lambda self: 1000")  # a global a method reads, a method replaced
        group.ok("%%ddp -o changed\n" + uses + "total()")
        assert group.ok("print(changed)").stdout.strip() == "{0: 1158, 1: 1164}"
    finally:
        group.ok("persistent._digest = original_digest")


def test_progress_bars_of_every_rank_leave_only_their_final_lines(group):
    out = group.ok(
        "%%ddp --output all\nfrom tqdm import tqdm\nimport time\n"
        "for i in tqdm(range(4), mininterval=0, ncols=60):\n    time.sleep(0.05)"
    )
    lines = out.stdout.splitlines()
    assert "\r" not in out.stdout and len(lines) == 2, out.stdout  # the bars were updated in place
    assert all("100%" in line for line in lines) and {line[:8] for line in lines} == {"[rank 0]", "[rank 1]"}


def test_a_refused_start_leaves_no_run(kernel):
    runs = "print(len([r for r in gpumagic.runs() if r.info['kind'] == 'ddp-group']))"
    before = kernel.ok(runs).stdout
    error = kernel.run("%ddp start --backend nccl --no-dashboard").error
    assert error[0] == "UsageError" and "could not join the process group" in error[1]
    assert kernel.ok(runs).stdout == before


def test_the_store_answers_after_the_group_formed_for_subgroups_and_nccl(group):
    # gloo meets once, inside init_process_group; dist.new_group (and NCCL's first collective) meet later on
    # the same store, which torch could no longer reach once its Python half was collected
    group.ok(
        "%%ddp -o sums\nimport gc, torch\ngc.collect()\npair = dist.new_group([0, 1])\n"
        "t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t, group=pair)\nt.item()"
    )
    assert group.ok("print(sums)").stdout.strip() == "{0: 3.0, 1: 3.0}"


def test_a_notebook_function_and_the_ones_it_calls_see_the_ranks_names(group):
    group.ok("def double():\n    return 2 * made_here\ndef outer():\n    return double() + 1")
    group.ok("%%ddp -o seen\nmade_here = rank + 10\nouter()")
    assert group.ok("print(seen)").stdout.strip() == "{0: 21, 1: 23}"
