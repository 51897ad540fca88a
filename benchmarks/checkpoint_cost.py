"""What ``gpumagic.checkpoint`` costs beside ``torch.save`` of the same state (issue #42), in one process.

    python benchmarks/checkpoint_cost.py [--mb 1024] [--repeat 5] [--tensors 64]

The state is a model's state dict of ``--tensors`` float32 tensors totalling ``--mb`` MB plus an Adam-like optimizer
state of twice that (``exp_avg``, ``exp_avg_sq``): what a training run saves. Each round writes it with plain
``torch.save(state, path)`` (a new file each round, two kept, as checkpoints are) and with
``gpumagic.checkpoint(step, model=..., optimizer=...)`` into a run directory on the same disk, in turn (each first
in every other round), ``--repeat`` times, then reads it back as many times, in turn too; the medians are compared.
Target: the checkpoint within 10 % of ``torch.save`` (it writes with ``torch.save`` and renames the file into place;
a thread then hashes it, seals the digest and keeps the last two while the caller trains on: the time until it is
sealed is shown too). ``os.sync()`` before each timed write: neither is throttled by the writeback of the other's
dirty pages. ``restore`` (which reads the file through once to check its seal before ``torch.load``) is timed beside
``torch.load`` for information. On a machine whose disk writes vary from run to run by more than the 10 % asked (a
VM), set ``GPUMAGIC_RUNS_DIR`` to a tmpfs (``/dev/shm/...``) to compare the work each does."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


class Model:
    """Stands for a model or optimizer: ``state_dict`` / ``load_state_dict`` over a dict of tensors."""

    def __init__(self, tensors: dict) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict:
        return self.tensors

    def load_state_dict(self, state: dict) -> None:
        for name, tensor in state.items():
            self.tensors[name].copy_(tensor)


def quiet_disk(pause_s: float) -> None:
    """Start a write with no dirty pages and the disk idle: neither write is throttled by the other's writeback
    (on a VM the host may still be writing for a while after ``sync`` returns)."""
    os.sync()
    time.sleep(pause_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=1024.0, help="the model's size in MB (the optimizer: twice)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--pause", type=float, default=2.0, help="seconds of an idle disk before each timed write")
    args = parser.parse_args()

    import torch

    import gpumagic
    from gpumagic.run_dirs import checkpoint_files
    from gpumagic.run_dirs.store import RUN_DIR_VARIABLE, new_run

    per_tensor = max(1, int(args.mb * 1e6 / 4 / args.tensors))
    model = Model({f"layer{i}.weight": torch.randn(per_tensor) for i in range(args.tensors)})
    optimizer = Model(
        {f"{kind}.{i}": torch.randn(per_tensor) for i in range(args.tensors) for kind in ("exp_avg", "exp_avg_sq")}
    )
    total = sum(t.numel() * 4 for t in (*model.tensors.values(), *optimizer.tensors.values()))
    run = new_run("bench-checkpoint")
    os.environ[RUN_DIR_VARIABLE] = str(run)
    with tempfile.TemporaryDirectory(dir=run) as scratch:
        saves, checkpoints, seals, loads, restores = [], [], [], [], []
        plain = Path(scratch) / "plain.pt"
        for round_ in range(args.repeat + 1):  # the first round warms the page cache and the seal's thread
            plain = Path(scratch) / f"plain-{round_}.pt"  # a new file each time, as each checkpoint is

            def save_plainly(plain: Path = plain) -> None:
                quiet_disk(args.pause)
                started = time.perf_counter()
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, plain)
                saves.append(time.perf_counter() - started)

            def checkpoint(round_: int = round_) -> None:
                quiet_disk(args.pause)
                started = time.perf_counter()
                gpumagic.checkpoint(round_, model=model, optimizer=optimizer)
                checkpoints.append(time.perf_counter() - started)
                checkpoint_files.settle()
                seals.append(time.perf_counter() - started)

            for write in (save_plainly, checkpoint) if round_ % 2 else (checkpoint, save_plainly):  # either first
                write()
            (Path(scratch) / f"plain-{round_ - 2}.pt").unlink(missing_ok=True)  # two kept, as checkpoints are
        for round_ in range(args.repeat + 1):  # then reading, in turn too

            def load_plainly(plain: Path = plain) -> None:
                started = time.perf_counter()
                loaded = torch.load(plain, map_location="cpu")
                model.load_state_dict(loaded["model"])
                optimizer.load_state_dict(loaded["optimizer"])
                loads.append(time.perf_counter() - started)

            def restore() -> None:
                started = time.perf_counter()
                gpumagic.restore(model=model, optimizer=optimizer)
                restores.append(time.perf_counter() - started)

            for read in (load_plainly, restore) if round_ % 2 else (restore, load_plainly):
                read()
        for measured in (saves, checkpoints, seals, loads, restores):
            del measured[0]
    save, check, sealed = statistics.median(saves), statistics.median(checkpoints), statistics.median(seals)
    load, restore = statistics.median(loads), statistics.median(restores)
    print(f"state: {total / 1e6:,.0f} MB in {3 * args.tensors} tensors; median of {args.repeat} rounds each")
    print(f"{'':34}{'seconds':>9}{'GB/s':>8}")
    print(f"{'torch.save':34}{save:9.3f}{total / save / 1e9:8.2f}")
    print(f"{'gpumagic.checkpoint (the call)':34}{check:9.3f}{total / check / 1e9:8.2f}")
    print(f"{'  ... until sealed (in a thread)':34}{sealed:9.3f}{total / sealed / 1e9:8.2f}")
    print(f"{'torch.load + load_state_dict':34}{load:9.3f}{total / load / 1e9:8.2f}")
    print(f"{'gpumagic.restore':34}{restore:9.3f}{total / restore / 1e9:8.2f}")
    print(f"checkpoint / torch.save: {check / save:.3f} (target <= 1.10); until sealed: {sealed / save:.3f}")
    print(f"restore / (torch.load + load_state_dict): {restore / load:.3f}")


if __name__ == "__main__":
    main()
