"""Notebook code as users write it, under %%launch_ddp in a real kernel: DataLoader workers and multiprocessing
pools over notebook classes, functions and lambdas; the kernel's environment and seed as they are at each
launch; a cell that makes its own process group (pytorch/examples' ddp_setup); the libraries ranks start with;
launches refused for their arguments. The kernel sees no GPU (CUDA_VISIBLE_DEVICES empty) and every launch says
--gpus none: gloo ranks on the CPU, on any machine."""

import re

import pytest

pytestmark = pytest.mark.kernel

WIDGET = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    from conftest import cpu_kernel

    with cpu_kernel(tmp_path_factory, "%load_ext gpumagic\nimport gpumagic, os") as k:
        yield k


def value(kernel, expression: str) -> str:
    """The repr of ``expression`` in the kernel."""
    return kernel.ok(f"print(repr({expression}))").stdout.strip()


def launched(kernel, cell: str, timeout: float = 120):
    """Run a %%launch_ddp cell that must succeed; its CellResult."""
    out = kernel.run(cell, timeout=timeout)
    assert out.status == "ok" and out.error is None, f"the launch failed: {out.error} {out.stderr}"
    return out


# 1. DataLoader workers and multiprocessing pools in the ranks

DATASET_CELL = """\
import torch

class DS(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.tensor([i], dtype=torch.float32)

def square(x):
    return x * x
"""

LOADER_LAUNCH = """\
%%launch_ddp -n 2 --gpus none -o sums
import multiprocessing
from torch.utils.data import DataLoader, DistributedSampler

dataset = DS()
loader = DataLoader(dataset, batch_size=8, num_workers=4, sampler=DistributedSampler(dataset, shuffle=False),
                    collate_fn=lambda b: torch.stack(b))
total = sum(batch.sum().item() for batch in loader)
with multiprocessing.Pool(2) as pool:
    squares = pool.map(square, range(5))
    cubes = pool.map(lambda x: x ** 3 + rank, range(5))
(total, squares, cubes)
"""


def test_dataloader_workers_and_pools_take_the_notebooks_classes_functions_and_lambdas(kernel):
    """DataLoader(num_workers=4) over a notebook Dataset with a lambda collate_fn, and Pool.map over a notebook
    function and a lambda, inside the ranks: the workers run them, and each rank gets its own shard's sums."""
    kernel.ok(DATASET_CELL)
    launched(kernel, LOADER_LAUNCH, timeout=180)
    assert value(kernel, "sums") == (
        "{0: (992.0, [0, 1, 4, 9, 16], [0, 1, 8, 27, 64]), 1: (1024.0, [0, 1, 4, 9, 16], [1, 2, 9, 28, 65])}"
    )  # rank 0 has the even items 0..62, rank 1 the odd ones


# 2. The kernel's environment at each launch


def test_each_launch_gets_the_kernels_environment_and_seed_as_they_are_now(kernel):
    """Variables set, changed or deleted in the kernel after its first launch reach the next launch's ranks;
    %gpu seed 42 seeds torch in every rank with 42."""
    seen = "import os, torch\n(os.environ.get('GPUMAGIC_TEST_X'), os.environ.get('GPUMAGIC_TEST_GONE'))"
    launched(kernel, "%%launch_ddp -n 2 --gpus none\npass")  # the first launch: the ranks' start is warm now
    try:
        kernel.ok("os.environ['GPUMAGIC_TEST_X'] = 'before'\nos.environ['GPUMAGIC_TEST_GONE'] = 'here'")
        launched(kernel, "%%launch_ddp -n 2 --gpus none -o first\n" + seen)
        assert value(kernel, "first") == "{0: ('before', 'here'), 1: ('before', 'here')}"
        kernel.ok("os.environ['GPUMAGIC_TEST_X'] = 'after'\ndel os.environ['GPUMAGIC_TEST_GONE']\n%gpu seed 42")
        seeded = seen[:-1] + ", os.environ.get('GPUMAGIC_SEED'), torch.initial_seed())"
        launched(kernel, "%%launch_ddp -n 2 --gpus none -o second\n" + seeded)
        assert value(kernel, "second") == "{0: ('after', None, '42', 42), 1: ('after', None, '42', 42)}"
    finally:
        kernel.ok(
            "for name in ('GPUMAGIC_TEST_X', 'GPUMAGIC_TEST_GONE', 'GPUMAGIC_SEED', 'PYTHONHASHSEED'):\n"
            "    os.environ.pop(name, None)"
        )


# 4. init_process_group in the cell

DDP_SETUP_CELL = """\
import os
import torch
from torch.distributed import init_process_group, destroy_process_group, all_reduce

def ddp_setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    init_process_group(backend="gloo", rank=rank, world_size=world_size)
"""

OWN_GROUP_CELLS = {
    "torch.distributed.init_process_group in the cell": (
        "import torch\n",
        "import torch\n"
        'torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)\n'
        "t = torch.tensor([rank + 1.0])\n"
        "torch.distributed.all_reduce(t)\n"
        "torch.distributed.destroy_process_group()\n"
        "t.item()\n",
    ),
    "ddp_setup from the notebook, functions from torch.distributed imported there": (
        DDP_SETUP_CELL,
        "ddp_setup(rank, world_size)\n"
        "t = torch.tensor([rank + 1.0])\n"
        "all_reduce(t)\n"
        "destroy_process_group()\n"
        "t.item()\n",
    ),
}


@pytest.mark.parametrize("setup, cell", OWN_GROUP_CELLS.values(), ids=list(OWN_GROUP_CELLS))
def test_a_cell_that_makes_its_own_process_group_runs_on_the_group_made_already(kernel, setup, cell):
    """A script's init_process_group(rank, world_size) ... destroy_process_group() runs as is: the call does
    nothing, and rank 0 says so in one line."""
    kernel.ok(setup)
    out = launched(kernel, "%%launch_ddp -n 2 --gpus none -o reduced\n" + cell)
    assert value(kernel, "reduced") == "{0: 3.0, 1: 3.0}"
    notes = [line for line in (out.stdout + out.stderr).splitlines() if "[gpumagic] init_process_group" in line]
    assert len(notes) == 1, notes
    assert notes[0].startswith("[rank 0] [gpumagic] init_process_group") and "already" in notes[0], notes


@pytest.mark.parametrize(
    "call",
    ['init_process_group("gloo", rank=rank, world_size=4)', 'init_process_group("gloo", rank=0, world_size=2)'],
    ids=["world_size 4 on 2 ranks", "rank 0 on every rank"],
)
def test_a_cell_asking_for_another_process_group_fails_naming_the_rank(kernel, call):
    """init_process_group for a group other than the one made already is a LaunchError that names the rank and
    says the group was made already, not torch's 'initialize the default process group twice'."""
    out = kernel.run(
        "%%launch_ddp -n 2 --gpus none\nfrom torch.distributed import init_process_group\n" + call, timeout=120
    )
    assert out.status == "error" and out.error is not None and out.error[0] == "LaunchError", out.error
    assert re.match(r"rank [01] failed", out.error[1]), out.error[1]
    assert "made the process group already" in out.error[1], out.error[1]
    assert "twice" not in out.error[1], out.error[1]


# 5. The libraries ranks start with


def test_ranks_start_with_the_heavy_libraries_the_kernel_imported_and_no_other_module(kernel):
    """After a warm launch the kernel imports tqdm and Pillow (heavy libraries) and mailbox (not one): a cell
    that does not mention them finds the heavy ones and torch._dynamo (DDP's) imported, mailbox not."""
    launched(kernel, "%%launch_ddp -n 2 --gpus none\npass")  # warm
    kernel.ok("import tqdm, PIL.Image, mailbox")
    launched(
        kernel,
        "%%launch_ddp -n 2 --gpus none -o loaded\nimport sys\n"
        "{m: m in sys.modules for m in ('tqdm', 'PIL', 'torch._dynamo', 'mailbox')}",
    )
    loaded = eval(value(kernel, "loaded"))
    for rank in (0, 1):
        heavy = {m: loaded[rank][m] for m in ("tqdm", "PIL", "torch._dynamo")}
        assert heavy == {"tqdm": True, "PIL": True, "torch._dynamo": True}, f"rank {rank} started without them"
        assert loaded[rank]["mailbox"] is False, f"rank {rank} was given mailbox, which is no heavy library"


# 10. Launches refused for their arguments


@pytest.mark.parametrize(
    "line", ["-n 0 --gpus none", "-n 2 --gpus none --timeout 0s", "-n 2 --gpus none --gpus-per-rank 0"]
)
def test_a_launch_refused_for_its_arguments_shows_only_its_one_line_error(kernel, line):
    """A refused %%launch_ddp is a one-line UsageError and displays nothing: no dashboard, no Stop button."""
    kernel.ok("from gpumagic.launch.kernel_side.session import SESSION\nd = SESSION.last_dashboard\nd and d.join()")
    out = kernel.run(f"%%launch_ddp {line}\nprint('ran')")
    assert out.status == "error" and out.error is not None and out.error[0] == "UsageError", out.error
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert WIDGET not in out.mimetypes and out.mimetypes == [], out.mimetypes
    assert "ran" not in out.stdout
