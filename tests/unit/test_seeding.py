import subprocess
import sys
import textwrap

import pytest

import gpumagic
from gpumagic.errors import InvalidArgument


@pytest.mark.slow
def test_seed_makes_python_numpy_and_torch_repeat():
    code = textwrap.dedent(
        """
        import random, numpy, torch, os, gpumagic
        def draw():
            return (random.random(), float(numpy.random.rand()), float(torch.rand(1)))
        report = gpumagic.seed(1234)
        first = draw()
        gpumagic.seed(1234)
        assert draw() == first, "not repeatable"
        gpumagic.seed(4321)
        assert draw() != first
        print(repr(report)); print(os.environ["GPUMAGIC_SEED"], os.environ["PYTHONHASHSEED"])
        print(torch.are_deterministic_algorithms_enabled())
        print(repr(gpumagic.seed(7, deterministic=True)))
        print(torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
              os.environ["CUBLAS_WORKSPACE_CONFIG"])
        print(torch.cuda.is_initialized())
        """
    )
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert lines[0] == "Seeded python, numpy, torch (CPU and all CUDA devices) with 1234"
    assert lines[1] == "4321 4321"
    assert lines[2] == "False"
    assert "deterministic algorithms on" in lines[3]
    assert lines[4] == "True False :4096:8"
    assert lines[5] == "False"  # seeding never starts CUDA


@pytest.mark.parametrize("value", [-1, 2**32, 1.5, "7", True])
def test_bad_seeds(value):
    with pytest.raises(InvalidArgument, match="seed"):
        gpumagic.seed(value)
