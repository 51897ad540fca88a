"""The process that carries one background job: ``python -m gpumagic.jobs.runner RUN_DIR``.

It detaches from the kernel (double fork, its own session: the kernel's interrupt, restart or shutdown do
not reach it), waits for the jobs named with ``after``, queues for GPUs (``jobs.queue``), holds their leases
while the job runs, starts the job's ranks with the launcher of ``%%launch_ddp`` (``spawn``: the ranks start
fresh, carrying their GPUs in their environment), and records everything in the job's directory
(``run_dirs.records``). Its process group is the job's: ``kill`` signals the group.

Kept light at import: the ``spawn`` ranks import this module as their main module, so what only the runner
needs of ``launch/`` and ``jobs/`` is imported where it is used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import cloudpickle

from gpumagic.devices.processes import process_start_time
from gpumagic.errors import DiskFull, InvalidArgument, RunsDirectoryError
from gpumagic.run_dirs import private, records, store
from gpumagic.run_dirs.launch_files import make_launch_directories, remove_launch_directories
from gpumagic.run_dirs.layout import RunFiles
from gpumagic.run_dirs.signing import PayloadRejected, read_sealed, write_sealed

_log = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m gpumagic.jobs.runner RUN_DIR  (gpumagic.submit starts it for you)\n")
        return 2
    if os.fork():  # the kernel waits only for this first process; the job runs in the grandchild
        os._exit(0)
    os.setsid()
    _Runner(Path(argv[0])).run()
    return 0


class _Runner:
    def __init__(self, run_dir: Any) -> None:
        self.run_dir = run_dir
        self.files = RunFiles(run_dir)
        self.signal: int | None = None
        self.name = "?"
        self.output: Any = None  # output.log, open while the job runs
        self.sink: Any = None  # a DDP job's ranks' output, line by line with [rank N], until the job ends
        self.output_error: OSError | None = None  # why the job's output could not be written
        self.cancel: Any = None  # set to stop the job's ranks

    def run(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._on_signal)
        try:  # before anything of the directory is read: it must be this user's own, in a safe place
            private.safe_root(self.run_dir.parent)
            private.check_own(self.run_dir)
        except RunsDirectoryError as err:
            sys.stderr.write(f"gpumagic: the job at {self.run_dir} will not run: {err}\n")
            return
        try:
            try:
                spec = records.read_spec(self.run_dir)  # what runs comes from the sealed description only
            except (PayloadRejected, OSError, ValueError) as err:
                self._fail_before_start(err)
                return
            self.name = spec.name
            sys.path[:0] = [p for p in spec.sys_path or [] if p not in sys.path]  # the ranks inherit it
            # the reason stays: "starting", or why the job waits, which the kernel recorded at the submission
            records.update(self.run_dir, runner_pid=os.getpid(), runner_start=process_start_time(os.getpid()))
            self._run_job(spec)
        except DiskFull as err:
            self._disk_full(err)
        finally:
            # lazy: the spawn ranks import this module as their main; only the runner needs leases
            from gpumagic.devices import leases

            leases.book().release_all()
            records.release_reserve(self.run_dir)  # _finish released it, unless the job ended without a record
        self._tell_the_end()

    def _tell_the_end(self) -> None:
        """Tell the job's targets how it ended, once its end is recorded and its GPUs are free (``jobs.notify``)."""
        # lazy: the spawn ranks import this module as their main; only the runner tells
        from gpumagic.jobs import notify

        try:
            status = records.read(self.run_dir).get("status", "")
        except (OSError, ValueError):
            _log.debug("the job's end cannot be read; nobody is told of it", exc_info=True)
            return
        if status in records.ENDED:
            notify.notify(self.run_dir, status)

    def _run_job(self, spec: records.JobSpec) -> None:
        try:
            if not self._wait_for_dependencies(spec):
                return
            self._run(spec, self._wait_for_gpus(spec))
        except DiskFull:
            raise
        except BaseException as err:  # noqa: BLE001 - whatever happens, the job's record must say it
            # a signal's KeyboardInterrupt, or what it became on its way out: raised in a class's __set_name__ (a
            # kill while the runner imports), Python 3.11 wraps it in a RuntimeError; the job was killed all the same
            if isinstance(err, KeyboardInterrupt) or self.signal is not None:
                started = records.read(self.run_dir).get("started")
                self._finish("killed", self._kill_reason("" if started else "while queued"))
                return
            _log.debug("the job could not run; its record says why", exc_info=True)
            report = "".join(traceback.format_exception(err))
            self._write(self.files.error, "gpumagic could not run the job:\n" + report)
            self._finish("failed", f"gpumagic could not run the job: {type(err).__name__}: {err}")

    def _fail_before_start(self, err: Exception) -> None:
        self._write(self.files.error, f"{err}\n")
        self._finish("failed", str(err), runner_pid=None)

    def _write(self, path: Any, text: str) -> None:
        private.write_private(path, text.encode())

    def _disk_full(self, err: Any, report: str = "", **fields: Any) -> None:
        """Record that the job failed because a file of it could not be written, and what it kept."""
        records.release_reserve(self.run_dir)  # the space held for this record and the error's
        why = f"disk full: {err.path} ({err.reason}); saved: {self._saved()}; free space or set GPUMAGIC_RUNS_DIR"
        with contextlib.suppress(OSError):
            text = f"The job was stopped: {why}\n" + (f"\n{report}\n" if report else "")
            self._write(self.files.error, text)
        self._finish("failed", why, **fields)

    def _saved(self) -> str:
        """What of the job is on disk: its output, its metrics, its result."""
        kept = []
        with contextlib.suppress(OSError):
            size = self.files.output.stat().st_size
            if size:
                kept.append(f"output.log ({size:,} bytes)")
        try:
            ranks = store.Run(self.run_dir, {}).metrics()
        except (OSError, ValueError):
            ranks = {}
        points = sum(len(series) for metrics in ranks.values() for series in metrics.values())
        if points:
            kept.append(f"metrics ({points:,} points)")
        if self.files.result.exists():
            kept.append("result.pkl")
        return ", ".join(kept) or "nothing"

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signal is None:
            self.signal = signum
            raise KeyboardInterrupt

    def _kill_reason(self, when: str = "") -> str:
        if self.files.kill_request.exists():
            return "killed with %jobs kill" + (f" {when}" if when else "")
        name = signal.Signals(self.signal).name if self.signal else "a signal"
        return f"killed by {name} sent to its runner" + (f" {when}" if when else "")

    def _finish(self, status: str, why: str, **fields: Any) -> None:
        """Record the job's end last: one who reads it finds all of the job's output and no disk held for it."""
        self._close_output()
        records.release_reserve(self.run_dir)  # the space held for this record
        store.record_end(self.run_dir, status, why, **fields)

    def _wait_for_dependencies(self, spec: records.JobSpec) -> bool:
        """Block until every ``after`` job has finished; False (job cancelled) if one did not."""
        # lazy: the spawn ranks import this module as their main; only the runner waits
        from gpumagic.jobs import executors

        pending = list(spec.after or [])
        last = None
        while pending:
            for name in list(pending):
                try:
                    status = executors.status(records.read(records.find(name)))
                except (InvalidArgument, OSError, ValueError):
                    status = "removed"
                if status == "finished":
                    pending.remove(name)
                elif status in records.ENDED or status == "removed":
                    self._finish("cancelled", f"cancelled: job {name}, which it runs after, {status}")
                    return False
            if pending:
                reason = "waiting for job " + ", ".join(pending) + " to finish"
                if reason != last:
                    records.update(self.run_dir, reason=reason)
                    last = reason
                time.sleep(0.25)
        return True

    def _wait_for_gpus(self, spec: records.JobSpec) -> list[Any]:
        # lazy: the spawn ranks import this module as their main; only the runner queues
        from gpumagic.jobs import queue

        request = queue.Request.from_json(spec.request)
        if request.wants == 0:
            return []
        waited = time.time() - float(spec.submitted)
        telling = None
        if spec.notify and spec.notify_wait_s:  # its targets hear once that it has waited that long
            telling = threading.Timer(max(0.0, spec.notify_wait_s - waited), self._tell_waiting, (spec.notify_wait_s,))
            telling.daemon = True
            telling.start()
        try:
            return queue.wait_for_gpus(
                self.name,
                request,
                float(spec.submitted),
                self.run_dir.name,
                lambda why: records.update(self.run_dir, reason=why),
            )
        finally:
            if telling is not None:
                telling.cancel()

    def _tell_waiting(self, waited_s: float) -> None:
        # lazy: the spawn ranks import this module as their main; only the runner tells
        from gpumagic.jobs import notify

        notify.notify(self.run_dir, "waiting", waited_s=waited_s)

    def _run(self, spec: records.JobSpec, gpus: list[Any]) -> None:
        # lazy: the spawn ranks import this module as their main; only the runner needs the launch
        from gpumagic.launch import failures
        from gpumagic.launch.hang_reports import HangFollower
        from gpumagic.launch.kernel_side import local
        from gpumagic.launch.kernel_side.output import RankOutput
        from gpumagic.launch.plan import LaunchPlan, place_on
        from gpumagic.launch.rank_side.checkpoints import ATTEMPT_VARIABLE
        from gpumagic.launch.rank_side.memory_cap import MEMORY_LIMIT_VARIABLE

        ddp = spec.ddp
        nprocs = ddp or 1
        uuids = [g.uuid for g in gpus]
        placed = place_on(  # the queue gave the job a multiple of its ranks
            uuids,
            nprocs,
            len(uuids) // nprocs,
            simulated=any(g.simulated for g in gpus),
            backend=spec.backend,
            process_group=bool(ddp),
        )
        backend = placed.backend
        reserve = spec.request.get("min_free")
        capped = spec.memory_limit and reserve  # each rank capped at the job's reservation (--memory-limit)
        files = self.files
        make_launch_directories(files)
        listener = local.store_listener(files)
        plan = LaunchPlan.on_this_machine(  # a CPU job's ranks see no GPU: the plan hides them
            self.run_dir,
            placed.rank_gpus,
            backend=backend,
            use_cuda=placed.use_cuda,
            master_port=local.loopback_port(None),
            timeout_s=float(spec.timeout_s or 1800.0),
            hang_after_s=float(spec.hang_after_s or 0.0) if ddp else 0.0,
            extra_env={
                ATTEMPT_VARIABLE: str(spec.attempt or 1),  # for restore's "resumed from step N (attempt 2)"
                **({MEMORY_LIMIT_VARIABLE: str(int(reserve))} if capped else {}),
            },
        )
        records.update(
            self.run_dir,
            status="running",
            reason="",
            started=time.time(),
            gpus=[g.nvml_index for g in gpus],
            gpu_uuids=uuids,
            backend=backend,
        )
        self.output = private.open_private(files.output)
        self.cancel = threading.Event()
        sink = self.sink = RankOutput(lambda text: self._output(text.encode()), "all", nprocs) if ddp else None
        hangs = HangFollower(
            self.run_dir,
            nprocs,
            plan.hang_after_s,
            show=lambda text: self._output(f"{text}\n".encode()),
            record=lambda report: records.update(self.run_dir, hang=report),
        )
        self._start_exporter(spec)
        try:
            packed = read_sealed(files.job_payload, f"job {self.name}'s code ({files.job_payload})")
            results = local.run_local(
                plan,
                packed,
                start_method="spawn",
                listener=listener,
                on_output=sink.feed if sink else (lambda rank, data: self._output(data)),
                on_start=lambda plan, pids: records.update(self.run_dir, pids=pids),
                cancel=self.cancel,
                on_poll=hangs.poll,
            )
            remove_launch_directories(files)  # the ranks' copies: a nearly full disk need not hold two
            write_sealed(files.result, cloudpickle.dumps(results if ddp else results.get(0)))
            self._finish("finished", "finished", exitcode=0)
        except failures.LaunchError as err:
            root = err.root_cause
            self._output(f"\n{err.report()}\n".encode())  # where a script's traceback would be
            unreported = root.exc_type is None and root.signal_name is None
            if root.exc_type == "DiskFull" or (unreported and private.out_of_space(self.run_dir)):
                self._disk_full(DiskFull(files.launch), err.report(), exitcode=root.exitcode)
                return
            self._write(self.files.error, err.report() + "\n")
            self._finish("failed", err.headline(), exitcode=root.exitcode, signal=root.signal_name)
        except (failures.LaunchInterrupted, KeyboardInterrupt):
            if self.output_error is not None:  # the ranks were stopped because their output could not be kept
                raise self.output_error from None
            self._finish("killed", self._kill_reason())
        except PayloadRejected as err:
            self._write(self.files.error, f"{err}\n")
            self._output(f"{err}\n".encode())
            self._finish("failed", str(err))
        finally:
            self._close_output()
            remove_launch_directories(files)

    def _start_exporter(self, spec: records.JobSpec) -> None:
        """A process that follows the job's metrics to the trackers chosen when it was submitted (``gpumagic.track``),
        if any, until the job's end is recorded. It leaves this process's tree at once (``telemetry.exporting``):
        ``%jobs kill`` signals the tree, and the exporter must outlive it to send the last points and end the
        tracker runs. What fails goes to the job's output and its ``run.json``."""
        if not spec.track:
            return
        # lazy: the spawn ranks import this module as their main; only a tracked job's runner starts one
        import subprocess

        # lazy: as above
        from gpumagic.telemetry import exporting

        try:
            subprocess.run(
                exporting.command(self.run_dir, detach=True),
                stdin=subprocess.DEVNULL,
                stdout=self.output,
                stderr=self.output,
                timeout=60,
            )
        except (OSError, subprocess.SubprocessError) as err:  # the job runs all the same
            _log.debug("the job's exporter did not start", exc_info=True)
            self._output(f"gpumagic: the job's metrics are not exported to its trackers: {err}\n".encode())

    def _close_output(self) -> None:
        """Write the ranks' last partial lines and close output.log (again: nothing)."""
        if self.sink is not None:
            self.sink.flush()
            self.sink = None
        if self.output is not None:
            self.output.close()

    def _output(self, data: bytes) -> None:
        """Append the job's output to output.log, all of a chunk or none of it (a full disk never leaves part
        of a line behind); if it cannot be written, stop the job (its output would be lost) and remember why."""
        if self.output_error is not None:
            return
        try:
            private.append_whole(self.output.fileno(), data)
        except OSError as err:
            self.output_error = private.disk_error(err, self.files.output)
            self.cancel.set()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
