"""A browser test's kernel: ``python kernel_launcher.py ENV_JSON -f CONNECTION_FILE``. The module's Jupyter server
was started for an earlier test; this sets the environment the test had when it asked for its notebook (kept
in ``ENV_JSON`` by ``tests/browser/pages.py``), keeps what the server adds for its kernels (``JPY_*``), and runs
ipykernel as a kernelspec's ``python -m ipykernel_launcher`` would."""

import json
import os
import runpy
import sys


def main() -> None:
    added_by_the_server = {key: value for key, value in os.environ.items() if key.startswith("JPY_")}
    with open(sys.argv[1]) as handle:
        environment = json.load(handle)
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(added_by_the_server)
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    sys.path[0] = os.getcwd()  # as ``python -m`` has it: the notebook's folder, not this one's
    runpy.run_module("ipykernel_launcher", run_name="__main__", alter_sys=True)


if __name__ == "__main__":  # not when pytest collects its doctests
    main()
