"""Warm start for background jobs: could a per-user daemon with torch preloaded bring submit -> first line
under 0.3 s without weakening isolation? Measurement and analysis only (nothing here is used by gpumagic).

    python benchmarks/warm_start.py [--repeats 5]

Printed, side by side in one run, medians of ``--repeats``:

1. today's path: ``gpumagic.submit(fn)`` -> the job's first line (runner ``python -m gpumagic.jobs.runner``,
   queue, lease, a ``spawn`` rank that imports torch), split with the job's own record (runner process
   alive, GPUs leased, first line);
2. the floors: a fresh ``python -c pass``, ``import gpumagic.jobs.runner``, ``import torch``, and a
   runner-style start without torch (interpreter, the runner's imports, double fork + setsid);
3. a prototype warm path (in this file only, ``--serve``): a daemon started once with torch,
   torch.distributed and cloudpickle imported, on a Unix socket in a private 0700 directory; per request it
   checks the peer's uid, forks (double fork + setsid, as the runner), and the grandchild applies the
   request's environment and cwd, unpickles the cloudpickled function and runs it; request -> first line,
   plain and after a gloo process group (world size 1) is made, next to the same in a fresh process;
4. memory: the idle daemon's RSS, a forked child's RSS/USS/PSS against a fresh process importing the same;
5. isolation probes: what a forked job sees that a fresh one does not (seed, threads, rlimit, cgroup).

Analysis (evidence from torch 2.13.0+cpu in .venv, CPython 3.11, Linux, cgroup v1, 2 CPUs shared with a
test run: load average ~3-4, so absolute times are inflated; the ratios hold)
--------------------------------------------------------------------------------------------------------

Time (medians of 5; ranges over the last two runs). Today submit -> first line is ~1.5-1.7 s: submit
returns at ~0.08 s, the runner process is alive at ~0.07-0.08 s and has its GPUs leased at ~0.23 s; the
remaining ~1.25-1.5 s is the spawn rank (fresh interpreter, ``import torch`` ~1.1-1.3 s alone, rank
set-up). A fork of a torch-loaded daemon reaches the job's first line ~0.02-0.035 s after the request is sent
(~0.025-0.04 s with a gloo group and an all_reduce; the group itself ~7-10 ms), so a warm path can reach the
0.3 s target: ~0.25-0.26 s if the runner stays a fresh interpreter and only its rank is forked (tight: no
margin under load), ~0.10-0.12 s if submit asks the daemon directly and the runner's queue/lease work runs in
the fork (the runner's interpreter start, ~0.13 s with its imports and double fork, leaves the path). The
daemon itself costs one cold start (~1.0-1.5 s, a torch import) per idle period, paid by the first job after
an idle exit: the target holds for warm submits only. NCCL/CUDA init on a real GPU (not measurable here) is
paid per rank after the fork in either design. Memory: the idle daemon holds ~222 MiB RSS (~146 MiB USS); a
forked job adds ~2 MiB USS until it touches pages (PSS ~75), against ~145 MiB USS for a fresh process with
the same imports.

Isolation: a forked job is *not* equivalent to a fresh spawn; every difference below was found here.

* Environment read once, at import, in the daemon (a job's own env applied after the fork is too late):
  - C level (LD_PRELOAD getenv logger, ``python -c "import torch"`` minus ``python -c pass``): libgomp
    (torch/lib/libgomp.so.1) reads OMP_NUM_THREADS, OMP_PROC_BIND, OMP_PLACES, GOMP_CPU_AFFINITY,
    OMP_WAIT_POLICY, GOMP_SPINCOUNT, OMP_STACKSIZE, OMP_DYNAMIC ... in its load-time constructor; numpy's
    OpenBLAS (numpy.libs/libscipy_openblas64_*.so) OPENBLAS_NUM_THREADS, OPENBLAS_CORETYPE,
    OPENBLAS_VERBOSE; libc10.so TORCH_CPP_LOG_LEVEL, PYTORCH_API_USAGE_STDERR; libtorch_cpu.so
    TORCH_SHOW_CPP_STACKTRACES, TORCH_CUSTOM_TERMINATE, TORCH_DISTRIBUTED_DEBUG, TORCH_BLAS_PREFER_CUBLASLT,
    TORCH_LINALG_PREFER_CUSOLVER, TORCH_ALLOW_TF32_CUBLAS_OVERRIDE, KINETO_USE_DAEMON, oneDNN's
    MKLDNN_*/ONEDNN_*/DNNL_DEFAULT_FPMATH_MODE, MKLDNN_VERBOSE; numpy NPY_ENABLE/DISABLE_CPU_FEATURES.
    Measured: a child forked from a daemon without OMP_NUM_THREADS that sets OMP_NUM_THREADS=1 keeps
    ``torch.get_num_threads() == 2`` and 3 threads after a numpy+torch matmul; a fresh process gets 1 and 1.
  - Python level (os.environ wrapped before ``import torch``): torch/__init__.py:406 TORCH_USE_RTLD_GLOBAL,
    :2888 TORCH_CUDA_SANITIZER, :3054 TORCH_DEVICE_BACKEND_AUTOLOAD (out-of-tree backends autoloaded at
    import); torch/_logging/_internal.py:899 TORCH_LOGS, :1043 TORCH_LOGS_FORMAT, :1123 TORCH_LOGS_OUT,
    :1165 TORCH_TRACE, :1169 TORCH_COMPILE_DEBUG, :1174 TORCH_DTRACE; torch/jit/_state.py:29 PYTORCH_JIT;
    torch/jit/_trace.py:180-182 PYTORCH_JIT_TIME/DISABLE/STATS; torch/profiler/__init__.py:57
    KINETO_USE_DAEMON; torch/_utils_internal.py:21 TORCH_COMPILE_STROBELIGHT; torch/_native/__init__.py:23
    TORCH_PYTHON_NATIVE_USER_GRAPH_ORDER_FN; torch/distributed/__init__.py:170 ``set_debug_level_from_env()``
    (TORCH_DISTRIBUTED_DEBUG); torch/distributed/config.py:20,27 TORCH_DISTRIBUTED_COMPILE_ON_ONE_RANK,
    TORCH_DISTRIBUTED_USE_TORCHCOMMS; config modules through torch/utils/_config_module.py:164
    (``env_name_default``: torch/compiler/config.py:48 TORCH_COMPILE_JOB_ID, :182 TORCH_CUDAGRAPH_GC,
    torch/fx/experimental/_config.py:10-66 TORCHDYNAMO_* ...); numpy/__init__.py:904,936
    NUMPY_MADVISE_HUGEPAGE, NPY_PROMOTION_STATE; numpy/_core/__init__.py:17 OPENBLAS_MAIN_FREE; tqdm
    (imported by torch) snapshots every TQDM_* variable (tqdm/utils.py:49). Lazily read, so still correct
    after a fork: CUDA_VISIBLE_DEVICES (torch/cuda/__init__.py:862, at CUDA init), PYTORCH_NVML_BASED_CUDA_CHECK
    (:166), allocator settings at first CUDA allocation.
* Threads: ``import torch`` starts numpy's OpenBLAS ``blas_thread_server`` thread (gdb backtrace of a
  process after ``import torch``: 2 tasks). fork() copies only the calling thread: the job starts with 1
  (OpenBLAS re-creates its server through its atfork handler); a lock held by another thread at fork time
  stays locked in the child forever. OpenMP is fork-safe here only because the daemon never ran a parallel
  region (GNU libgomp's pool, once used, is not re-created after fork): the daemon must run no tensor op,
  start no thread of its own, and fork from its only thread (the prototype does).
* Shared random state: the default CPU generator is seeded non-deterministically once per process
  (``torch.initial_seed()`` differs between fresh processes) and is copied by fork: every job forked from one
  daemon gets the *same* seed and the same ``torch.rand`` stream (probe below), and the same str hash seed
  (PYTHONHASHSEED fixed at daemon start). Python's ``random`` reseeds itself after fork (random.py
  ``os.register_at_fork``); numpy.random would not if the daemon imported it. The child must reseed torch
  (and numpy) from os.urandom, which changes behaviour anyone relying on "unseeded = different" expects.
* sys.modules / sys.path / code: the child sees the daemon's modules (torch of the version installed when the
  daemon started: a ``pip install -U torch`` or an edited gpumagic goes unseen until it restarts), its
  ``sys.path`` (PYTHONPATH, cwd '' at daemon start), ``sys.executable`` and venv. A daemon must be keyed by
  (uid, interpreter, venv, torch/gpumagic versions and mtimes) and must never import user modules. Its
  ``__main__`` is the daemon's script (probe ``main_module``: warm_start.py, fresh: -c), so a job that pickles
  by reference to ``__main__`` or reads ``sys.argv`` sees the daemon's (gpumagic.launch.rank_side.rank installs the
  notebook's ``__main__`` for its ranks; a forked job must do the same).
* rlimits, umask, nice, scheduling/cpu affinity, cgroup, namespaces, supplementary groups: inherited from the
  daemon, not from the kernel that submits. The probe lowers RLIMIT_NOFILE in the submitting process after the
  daemon started: a fresh process sees the lower limit, the forked job the daemon's. RLIMIT_MEMLOCK matters
  for NCCL/IB. With cgroups (systemd, JupyterHub's per-user limits, k8s) the job stays in the cgroup of the
  kernel/server that happened to start the daemon: its memory/CPU/pids and *device* (GPU) limits, its
  accounting, and its fate (stopping that server's scope or pod kills the daemon and every job forked from it),
  not those of the kernel that submitted. Today's runner is a child of the submitting kernel, so it has that
  kernel's cgroup and limits (the same as a user running ``python train.py`` from there).
* Stale daemon environment: what is not in the request comes from the daemon's start (HOME, PATH, LD_*,
  CUDA libraries already mapped, locale). The request must carry the whole environment (clear + update, as
  gpumagic.launch.rank_side.runtime.set_environment does for its forkserver ranks), and even then the import-time reads
  above are stale: a daemon has to refuse (or restart for) a request whose environment differs from its own
  in any import-time variable, i.e. effectively keep one daemon per distinct import-time environment.
* CUDA: the daemon must never initialize CUDA (nor NVML-through-CUDA): ``torch.cuda.is_available()`` itself
  calls ``_cuda_getDeviceCount`` (torch/cuda/__init__.py:188) which runs cuInit and poisons every later fork
  ("Cannot re-initialize CUDA in forked subprocess", :518). Any preloaded library that probes CUDA at
  import (several do) breaks all jobs; the daemon must assert ``not torch.cuda.is_initialized()`` before each
  fork and refuse otherwise.
* Socket security: the daemon executes whatever code it is sent, as its user. The socket must live in a
  0700 directory owned by the user (XDG_RUNTIME_DIR or a checked private dir, never an abstract-namespace
  socket, which has no permissions), the daemon must check SO_PEERCRED uid == its own on every connection,
  and the payload should stay sealed (gpumagic.run_dirs.signing HMAC) and be unpickled only in the child, never
  in the daemon (the prototype sends a JSON header and raw payload bytes for this reason).
* Killing and records: after the double fork the job leads its own session/group, as today, so
  ``kill`` by group works, but it is no longer a descendant of the kernel or of a runner: the daemon must
  report the pid (and start time, against pid reuse) before the code runs, someone must reap it (the daemon
  as a child subreaper, otherwise init) and record its exit status and signal in run.json. Today the runner
  is the parent that waits for the ranks and records how they ended, with ``lost`` when the runner vanishes;
  with a daemon that role must move into the forked child itself (fork the runner, which then forks ranks),
  otherwise exit codes are lost. The daemon's idle exit must not take running jobs with it (setsid, no
  PDEATHSIG), and a killed daemon must not leave half-forked requests unrecorded.

Recommendation: the target is reachable for warm submits (~0.12 s measured path + queue work), but a daemon
is safe only if it (1) is keyed by uid + interpreter + venv + package versions + the import-time environment
(the variables above, hashed) and refuses or restarts otherwise; (2) takes rlimits, umask, nice, affinity,
cwd, full environment, sys.path and ``__main__`` from each request, and reseeds torch/numpy and re-reads the
C-level settings (``torch.set_num_threads``, ``set_debug_level_from_env``) in the child; (3) never touches
CUDA/NVML, runs no op or thread, and checks ``torch.cuda.is_initialized()`` before each fork; (4) listens only
in a 0700 per-user directory with SO_PEERCRED checks and sealed payloads unpickled in the child; (5) forks
the runner itself (so exit codes and ``lost`` stay recorded as today), as a subreaper, ends only when idle
with no child alive, and (6) is not used when the submitting kernel's cgroup differs from the daemon's
(``/proc/self/cgroup`` compared on each request): then today's fresh spawn is the fallback. Items 1 and 6
mean in practice a daemon per kernel environment: it helps repeated submits from one session, much like
gpumagic's kernel-tied forkserver (launch.rank_server) does for ``%%launch_ddp``, but outliving the kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IDLE_EXIT_S = 120.0  # the prototype daemon ends after this long without a request


# ---------------------------------------------------------------------------------------------- jobs' code
def first_line() -> float:
    import time

    return time.time()


def ddp_first_line() -> dict:
    """What a DDP rank needs before the user's code: a process group (gloo, world size 1), one all_reduce."""
    import socket
    import time

    began = time.time()
    import torch
    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    dist.all_reduce(torch.ones(1))
    first = time.time()
    dist.destroy_process_group()
    return {"first": first, "group_s": first - began}


def hold(stamp: str, seconds: float) -> float:
    """Stamp a file, then stay alive while the benchmark reads this process's memory."""
    import time

    now = time.time()
    with open(stamp, "w") as handle:
        handle.write(repr(now))
    time.sleep(seconds)
    return now


def probe() -> dict:
    """What a job sees of its process: the facts that differ between a fork of the daemon and a fresh spawn."""
    import os
    import resource
    import sys

    import numpy
    import torch

    with open("/proc/self/cgroup") as handle:
        cgroup = next(line.strip() for line in handle if ":memory:" in line or line.startswith("0::"))
    seed, rand = torch.initial_seed(), float(torch.rand(1))
    a, t = numpy.ones((256, 256)), torch.ones(256, 256)
    a @ a, t @ t
    return {
        "torch_seed": seed,
        "torch_rand": rand,
        "str_hash": hash("gpumagic"),
        "torch_threads": torch.get_num_threads(),
        "threads_after_matmul": len(os.listdir("/proc/self/task")),
        "nofile_soft": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "main_module": os.path.basename(getattr(sys.modules["__main__"], "__file__", None) or "-c"),
        "memory_cgroup": cgroup,
        "cuda_initialized": torch.cuda.is_initialized(),
    }


# -------------------------------------------------------------------------------------- the prototype daemon
def _send(conn: socket.socket, data: bytes) -> None:
    conn.sendall(struct.pack("!I", len(data)) + data)


def _recv(conn: socket.socket) -> bytes | None:
    head = _recv_exact(conn, 4)
    if head is None:
        return None
    return _recv_exact(conn, struct.unpack("!I", head)[0])


def _recv_exact(conn: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = conn.recv(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def serve(directory: str) -> None:
    """The daemon: preload, listen, fork a detached job per request. Never unpickles anything itself."""
    import signal

    import cloudpickle  # noqa: F401 - preloaded for the children
    import torch
    import torch.distributed

    assert not torch.cuda.is_initialized()
    mode = os.stat(directory).st_mode & 0o777
    if mode != 0o700 or os.stat(directory).st_uid != os.getuid():
        sys.exit(f"refusing {directory}: mode {mode:o}, must be 0700 and mine")
    path = os.path.join(directory, "daemon.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(64)
    listener.settimeout(IDLE_EXIT_S)
    with open(os.path.join(directory, "ready"), "w") as handle:
        handle.write(repr(time.time()))
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            break  # idle: end (jobs already forked live on, in their own sessions)
        conn.settimeout(None)
        with conn:
            _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid():
                continue  # another user: never run their code
            header = _recv(conn)
            payload = _recv(conn)
            if header is None or payload is None:
                continue
            request = json.loads(header)
            if request.get("op") == "stop":
                break
            if torch.cuda.is_initialized():  # a fork would be poisoned: refuse rather than run a broken job
                _send(conn, json.dumps({"error": "CUDA initialized in the daemon"}).encode())
                continue
            middle = os.fork()
            if middle == 0:  # the first child: a new session, then the job in a grandchild; exits at once
                try:
                    listener.close()
                    os.setsid()
                    if os.fork() == 0:
                        signal.signal(signal.SIGINT, signal.SIG_DFL)
                        _child(conn, request, payload)  # never returns
                finally:
                    os._exit(0)
            os.waitpid(middle, 0)  # the job is the grandchild: init (or a subreaper) reaps it
    listener.close()
    os.unlink(path)


def _child(conn: socket.socket, request: dict, payload: bytes) -> None:
    """In the job: the request's environment, cwd and path, then its code; report the pid, then the value."""
    import traceback

    code = 0
    try:
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.path[:] = request["sys_path"]
        _send(conn, json.dumps({"pid": os.getpid()}).encode())
        import cloudpickle

        fn, args = cloudpickle.loads(payload)
        _send(conn, json.dumps({"result": fn(*args)}).encode())
    except BaseException:  # noqa: BLE001 - the prototype reports every failure to the caller
        code = 1
        try:
            _send(conn, json.dumps({"error": traceback.format_exc()}).encode())
        except OSError:
            pass
    finally:
        conn.close()
        os._exit(code)


class Daemon:
    """Client side: start the prototype daemon (as gpumagic would, on demand) and send it jobs."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="gpumagic-warm-")  # 0700, this user's
        self.path = os.path.join(self.directory, "daemon.sock")
        began = time.time()
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--serve", self.directory],
            cwd=str(REPO),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        ready = os.path.join(self.directory, "ready")
        while not os.path.exists(ready):
            if self.process.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.process.returncode}")
            time.sleep(0.005)
        time.sleep(0.01)
        self.start_s = float(Path(ready).read_text()) - began

    def submit(self, fn, *args, env: dict | None = None) -> tuple[socket.socket, int, float]:
        """Send ``fn(*args)``; returns the open connection, the job's pid and when the request began."""
        import cloudpickle

        began = time.time()
        payload = cloudpickle.dumps((fn, args))
        header = {
            "env": dict(os.environ if env is None else env),
            "cwd": os.getcwd(),
            "sys_path": list(sys.path),
        }
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        _send(conn, json.dumps(header).encode())
        _send(conn, payload)
        first = json.loads(_recv(conn) or b"{}")
        if "pid" not in first:
            raise RuntimeError(f"the daemon refused the job: {first}")
        return conn, first["pid"], began

    def run(self, fn, *args, env: dict | None = None) -> tuple[object, float]:
        conn, _, began = self.submit(fn, *args, env=env)
        with conn:
            answer = json.loads(_recv(conn) or b"{}")
        if "result" not in answer:
            raise RuntimeError(f"the warm job failed: {answer.get('error', answer)}")
        return answer["result"], began

    def stop(self) -> None:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(self.path)
                _send(conn, json.dumps({"op": "stop"}).encode())
                _send(conn, b"")
            self.process.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        import shutil

        shutil.rmtree(self.directory, ignore_errors=True)


# ------------------------------------------------------------------------------------------- measurements
def fresh_first_line(code: str, env: dict | None = None) -> float:
    """A fresh interpreter running ``code`` that prints time.time(): seconds from Popen to that line."""
    began = time.time()
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=str(REPO), env=env, check=True
    )
    return float(out.stdout.split()[-1]) - began


RUNNER_STYLE = """
import os, sys, time
import gpumagic.jobs.runner
if os.fork():
    os._exit(0)
os.setsid()
from gpumagic.jobs import queue
from gpumagic.run_dirs import records
from gpumagic.launch import plan
from gpumagic.launch.kernel_side import local
from gpumagic.launch.rank_side import rank
from gpumagic.run_dirs import signing
from gpumagic.launch.kernel_side import output
import cloudpickle, psutil
with open(sys.argv[1], "w") as handle:
    handle.write(repr(time.time()))
"""


def runner_style_start() -> float:
    """A runner without torch: interpreter, the runner's imports, double fork + setsid, as _start_runner."""
    stamp = tempfile.mktemp(prefix="gpumagic-warm-stamp-")
    began = time.time()
    subprocess.Popen([sys.executable, "-c", RUNNER_STYLE, stamp], cwd=str(REPO), stdin=subprocess.DEVNULL).wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            text = Path(stamp).read_text()
            if text:
                os.unlink(stamp)
                return float(text) - began
        except OSError:
            pass
        time.sleep(0.002)
    raise TimeoutError("the runner-style process never stamped")


def create_time_offset() -> float:
    """psutil's create_time (what the runner records as runner_start) is off by up to 1 s here (boot time in
    whole seconds): its offset from time.time(), measured on a child started now."""
    import psutil

    offsets = []
    for _ in range(3):
        began = time.time()
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
        offsets.append(psutil.Process(child.pid).create_time() - began)
        child.wait()
    return statistics.median(offsets)


def todays_path(repeats: int) -> dict[str, list[float]]:
    import gpumagic

    offset = create_time_offset()
    out: dict[str, list[float]] = {k: [] for k in ("returns", "runner", "leased", "first")}
    for _ in range(repeats):
        began = time.time()
        job = gpumagic.jobs_with(name=None).submit(first_line)
        out["returns"].append(time.time() - began)
        job.wait("2m")
        first = job.result()
        info = job.info
        out["first"].append(first - began)
        out["runner"].append((info.get("runner_start") or began) - offset - began)
        out["leased"].append((info.get("started") or began) - began)
        job.remove()
    return out


def memory(process: int) -> dict[str, float]:
    import psutil

    info = psutil.Process(process).memory_full_info()
    return {k: getattr(info, k) / 2**20 for k in ("rss", "uss", "pss")}


def wait_for(path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not (os.path.exists(path) and os.path.getsize(path)):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.01)


def memory_section(daemon: Daemon) -> dict[str, dict[str, float]]:
    stamp = tempfile.mktemp(prefix="gpumagic-warm-hold-")
    conn, pid, _ = daemon.submit(hold, stamp, 3.0)
    with conn:
        wait_for(stamp)
        time.sleep(0.3)
        forked = memory(pid)
        _recv(conn)
    os.unlink(stamp)
    fresh = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import torch, torch.distributed, cloudpickle, time; print('ready', flush=True); time.sleep(3)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(REPO),
    )
    fresh.stdout.readline()
    time.sleep(0.3)
    spawned = memory(fresh.pid)
    fresh.wait()
    return {"daemon": memory(daemon.process.pid), "forked": forked, "fresh": spawned}


def isolation_section(daemon: Daemon) -> tuple[list[dict], list[dict]]:
    """Two warm jobs and two fresh processes, each asked for OMP_NUM_THREADS=1, after this process (the
    'kernel') lowered its RLIMIT_NOFILE soft limit: what each job sees."""
    import resource

    import cloudpickle

    env = dict(os.environ, OMP_NUM_THREADS="1")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 512), hard))
    try:
        warm = [daemon.run(probe, env=env)[0] for _ in range(2)]
        code = (
            "import cloudpickle, json, sys; fn = cloudpickle.loads(bytes.fromhex(sys.argv[1])); print(json.dumps(fn()))"
        )
        blob = cloudpickle.dumps(probe).hex()
        fresh = [
            json.loads(
                subprocess.run(
                    [sys.executable, "-c", code, blob],
                    capture_output=True,
                    text=True,
                    env=env,
                    cwd=str(REPO),
                    check=True,
                ).stdout
            )
            for _ in range(2)
        ]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return warm, fresh


def line(label: str, values: list[float], note: str = "") -> None:
    median = statistics.median(values)
    spread = f"[{min(values):.3f}-{max(values):.3f}]"
    print(f"  {label:<52} {median:8.3f} s  {spread:<15} {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--serve", metavar="DIR", help=argparse.SUPPRESS)  # the prototype daemon itself
    options = parser.parse_args()
    if options.serve:
        serve(options.serve)
        return
    n = options.repeats
    os.environ["GPUMAGIC_RUNS_DIR"] = tempfile.mkdtemp(prefix="gpumagic-bench-runs-")
    os.environ["GPUMAGIC_LEASE_DIR"] = tempfile.mkdtemp(prefix="gpumagic-bench-leases-")
    os.environ["GPUMAGIC_SIMULATE"] = "4xA100-80GB"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    print(f"warm start, medians of {n} [min-max]; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")

    today = todays_path(n)
    floors = {
        "python -c pass": [fresh_first_line("import time; print(time.time())") for _ in range(n)],
        "python -c 'import gpumagic.jobs.runner'": [
            fresh_first_line("import time, gpumagic.jobs.runner; print(time.time())") for _ in range(n)
        ],
        "python -c 'import torch'": [fresh_first_line("import time, torch; print(time.time())") for _ in range(n)],
        "runner-style start (imports, double fork), no torch": [runner_style_start() for _ in range(n)],
    }
    fresh_ddp = [
        fresh_first_line(
            "import time, torch, torch.distributed as d, socket\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); p = s.getsockname()[1]; s.close()\n"
            "d.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{p}', rank=0, world_size=1)\n"
            "d.all_reduce(torch.ones(1)); print(time.time()); d.destroy_process_group()"
        )
        for _ in range(n)
    ]

    daemon = Daemon()
    try:
        daemon.run(first_line)  # one warm-up: the first fork touches the daemon's pages once
        warm = []
        for _ in range(n):
            value, began = daemon.run(first_line)
            warm.append(value - began)
        warm_ddp, group = [], []
        for _ in range(n):
            value, began = daemon.run(ddp_first_line)
            warm_ddp.append(value["first"] - began)
            group.append(value["group_s"])
        mem = memory_section(daemon)
        warm_probe, fresh_probe = isolation_section(daemon)
    finally:
        daemon.stop()

    print("\n1. today: gpumagic.submit(fn) -> the job's first line (free simulated GPU)")
    line("gpumagic.submit returns", today["returns"], "(kernel side)")
    line("runner process alive (runner_start)", today["runner"], "(python -m gpumagic.jobs.runner, forked)")
    line("GPUs leased, job marked running (started)", today["leased"], "(runner imports, records, queue)")
    line("job's first line", today["first"], "(+ spawn rank: fresh interpreter, import torch)")
    rank_part = [f - s for f, s in zip(today["first"], today["leased"], strict=True)]
    line("  of which started -> first line", rank_part, "(the part a warm fork replaces)")

    print("\n2. floors: a fresh process's first line")
    for label, values in floors.items():
        line(label, values)
    line("python: torch + gloo group (world 1) + all_reduce", fresh_ddp, "(fresh DDP rank floor)")

    print("\n3. warm: request to a torch-loaded daemon (fork, setsid, env, cwd, unpickle) -> first line")
    print(f"  daemon cold start (Popen -> listening, torch imported)   {daemon.start_s:8.3f} s  (once per idle period)")
    line("request -> first line", warm)
    line("request -> first line after gloo group + all_reduce", warm_ddp)
    line("  of which the process group (in the child)", group)
    estimate = [statistics.median(today["leased"]) + w for w in warm]
    line("estimate: today's runner + queue, then a warm fork", estimate, "(runner stays a fresh process)")
    direct = [statistics.median(today["returns"]) + w for w in warm]
    line("estimate: submit asks the daemon, which forks the job", direct, "(+ the queue/lease work in the fork)")

    print("\n4. memory (MiB)")
    for name, label in (
        ("daemon", "idle daemon (torch, torch.distributed, cloudpickle)"),
        ("forked", "forked job, running"),
        ("fresh", "fresh process importing the same"),
    ):
        m = mem[name]
        print(f"  {label:<52} RSS {m['rss']:7.1f}  USS {m['uss']:7.1f}  PSS {m['pss']:7.1f}")

    print("\n5. isolation probes: two warm jobs | two fresh processes, each given OMP_NUM_THREADS=1, after the")
    print("   submitting process lowered its RLIMIT_NOFILE soft limit to 512")
    for key in (
        "torch_seed",
        "torch_rand",
        "str_hash",
        "torch_threads",
        "threads_after_matmul",
        "nofile_soft",
        "main_module",
        "memory_cgroup",
        "cuda_initialized",
    ):
        warm_values = " ".join(str(p[key]) for p in warm_probe)
        fresh_values = " ".join(str(p[key]) for p in fresh_probe)
        print(f"  {key:<20} warm: {warm_values:<45} | fresh: {fresh_values}")


if __name__ == "__main__":
    main()
