"""A rank's process group: joining it through its own store (``secure_store``: only the user's processes get
in), leaving it, re-forming it (a persistent group's rank), and the user's own ``init_process_group`` calls,
accepted when they ask for the group gpumagic made or served on the launch's store when the code makes its
own (``spawn``). Everything here replaces or calls ``torch.distributed``; torch is imported when first used."""

from __future__ import annotations

import datetime
import functools
import gc
import hashlib
import inspect
import logging
import os
import socket
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from gpumagic.launch import secure_store
from gpumagic.launch.store_server import serve_and_connect
from gpumagic.run_dirs.launch_files import publish_store, published_store, store_key
from gpumagic.run_dirs.layout import RunFiles

_log = logging.getLogger(__name__)

_STORE_SERVERS: list[Any] = []  # the stores this rank serves: alive while the rank runs (or until left)
_USERS_STORE: list[Any] = []  # the store of the groups the user's own code makes (``spawn``)
_ENDED_PROCESS_GROUPS: list[Any] = []  # groups ``destroy_process_group`` ended: alive until the rank exits
PUBLISHED_LOOK_S = (0.01, 0.2)  # how often a rank looks for rank 0's published store: first, at most
TOKEN_VARIABLE = "GPUMAGIC_STORE_TOKEN"  # the token a Slurm attempt's ranks publish their store under


@dataclass(frozen=True)
class StorePlace:
    """Where a rank's group meets. Every store is the run's own (its key: ``store_key(files)``):

    - at a known ``address``: a local launch's Unix socket (rank 0 serves it, on ``listener`` when the launcher
      bound it), or, with ``served_prefix``, a static rendezvous that the agent serves (every rank a client,
      proving the rendezvous ``name`` the run's spec gives it);
    - published (``token``): rank 0 binds a port of its own on ``host`` and publishes the address in the run
      directory (``publish_store``), where the other ranks read it: an elastic round's store, a Slurm job's.
      Nobody can predict the port or take it first (issue #37).
    """

    address: str = ""
    listener: Any = None
    served_prefix: str | None = None
    name: str | None = None
    host: str = ""
    token: str = ""


def environment_store_place(files: RunFiles, spec: dict[str, Any]) -> StorePlace:
    """The store of a rank started with torchrun's variables (an elastic agent's worker, a Slurm task):
    ``GPUMAGIC_STORE`` if set; the agent's own store for a static rendezvous; else rank 0's, published under
    a token of this round (the agent's MASTER_ADDR and MASTER_PORT, which differ from round to round)."""
    given = os.environ.get(secure_store.VARIABLE)
    if given:
        return StorePlace(address=given)
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # a static rendezvous: the agent serves it
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        name = rendezvous_name(spec["rdzv_endpoint"]) if spec.get("rdzv_endpoint") else None
        return StorePlace(address=secure_store.tcp_address(host, port), served_prefix=f"/worker/attempt_{attempt}",
                          name=name)  # fmt: skip
    token = os.environ.get(TOKEN_VARIABLE) or hashlib.sha256(f"{host}:{port}".encode()).hexdigest()[:16]
    return StorePlace(host=host, token=token)


def rendezvous_name(endpoint: str) -> str:
    """The address a multi-node run's rendezvous is named by in every proof: as the run's spec gives it, however
    an agent was told to reach it."""
    host, _, port = endpoint.rpartition(":")
    return secure_store.tcp_address(host.strip("[]"), port)


def group_store(
    files: RunFiles,
    place: StorePlace,
    rank: int,
    timeout_s: float,
) -> Any:
    """The process group's store (``secure_store``: only this run's own processes get in). Rank 0 serves it:
    on ``place.listener`` (bound by the launcher) when given, else on a socket it binds itself, never on every
    interface."""
    # lazy: torch, in rank processes only
    import torch.distributed as dist

    key = store_key(files)
    if place.served_prefix is not None:
        client = secure_store.connect(place.address, timeout_s, key=key, role=secure_store.RENDEZVOUS, name=place.name)
        return dist.PrefixStore(place.served_prefix, client)
    if place.token and rank != 0:
        return _published_store(files, place, timeout_s, key)
    if rank != 0:
        return secure_store.connect(place.address, timeout_s, key=key, role=secure_store.GROUP)
    address, listener = place.address, place.listener
    if place.token:  # a port of its own choosing, published once it is bound: nobody can take it first
        listener = secure_store.listen(secure_store.tcp_address(place.host, 0))
        address = secure_store.listener_address(listener, place.host)
        os.environ["MASTER_PORT"] = str(listener.getsockname()[1])  # for code that reads it
    elif listener is None:
        listener = secure_store.listen(address)
    server, store = serve_and_connect(listener, address, timeout_s, key=key, role=secure_store.GROUP)
    _STORE_SERVERS.append(server)
    if place.token:
        publish_store(files, place.token, address)
    return store


def _published_store(files: RunFiles, place: StorePlace, timeout_s: float, key: bytes) -> Any:
    """A client of the store rank 0 published under ``place.token``, once it is there and proves it is this
    run's. An address that does not prove it (rank 0 of an earlier round and a stranger on its old port) is
    dropped, said in one line, and looked up again."""
    deadline = time.monotonic() + timeout_s
    pause, dropped = PUBLISHED_LOOK_S[0], set()
    while True:
        address = published_store(files, place.token)
        if address is not None and address not in dropped:
            try:
                store = secure_store.connect(
                    address, max(0.1, min(5.0, deadline - time.monotonic())), key=key, role=secure_store.GROUP
                )
                os.environ["MASTER_PORT"] = address.rsplit(":", 1)[1]  # for code that reads it
                return store
            except secure_store.StoreRefused as err:
                sys.stderr.write(f"[gpumagic] {err}; waiting for rank 0 to publish its store again\n")
                dropped.add(address)
            except TimeoutError:
                pass  # rank 0 has gone since it published: a restart publishes anew
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"rank 0 did not serve the group's store within {timeout_s:g}s (nothing published in {files.launch})"
            )
        time.sleep(pause)
        pause = min(pause * 2, PUBLISHED_LOOK_S[1])


def close_served_stores() -> None:
    """Stop serving the stores of groups this rank left (a persistent group's rank, before a re-form)."""
    while _STORE_SERVERS:
        _STORE_SERVERS.pop().close()


def join_process_group(
    files: RunFiles,
    place: StorePlace,
    backend: str,
    rank: int,
    world_size: int,
    timeout_s: float,
) -> None:
    """Join the process group through its store (``group_store``).

    With gloo every rank then waits at a barrier, so that none finishes and exits while a peer is still
    connecting to it (``Gloo connectFullMesh failed ... Connection closed by peer``).
    """
    # lazy: torch, in rank processes only
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = group_store(files, place, rank, timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    if backend == "gloo" and world_size > 1:
        dist.barrier()


def leave_process_group() -> None:
    # lazy: torch, in rank processes only
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# --- a persistent group's rank: joined again and again -----------------------------------------------------


def join_tracking_sockets(
    files: RunFiles, place: StorePlace, backend: str, rank: int, world_size: int, timeout_s: float
) -> dict[int, int]:
    """``join_process_group``; the connections the group opened (file descriptor -> inode), for
    ``break_connections``."""
    before = set(_socket_inodes().values())
    join_process_group(files, place, backend, rank, world_size, timeout_s)
    return {fd: inode for fd, inode in _socket_inodes().items() if inode not in before}


def break_connections(backend: str, sockets: dict[int, int]) -> None:
    """End every connection of the process group now, from any thread: a collective waiting on a peer fails
    at once ("Connection closed by peer") instead of after the group's timeout. NCCL groups are aborted."""
    if backend != "gloo":
        try:
            # lazy: torch, in rank processes only
            from torch.distributed import distributed_c10d

            distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 - the kernel kills the rank if it stays stuck
            _log.debug("the process group could not be aborted; the kernel kills a stuck rank", exc_info=True)
    for fd, inode in sockets.items():
        try:
            if os.stat(f"/proc/self/fd/{fd}").st_ino != inode:
                continue
            connection = socket.socket(fileno=fd)
        except OSError:
            _log.debug("socket %d cannot be taken over; it is left as it is", fd, exc_info=True)
            continue
        try:
            if connection.family in (socket.AF_INET, socket.AF_INET6) and not connection.getsockopt(
                socket.SOL_SOCKET, socket.SO_ACCEPTCONN
            ):
                connection.shutdown(socket.SHUT_RDWR)  # the store's connections are Unix sockets: they stay
        except OSError:
            _log.debug("socket %d could not be shut down; it is left as it is", fd, exc_info=True)
        finally:
            connection.detach()


def leave_broken_group() -> None:
    """Leave a process group whose connections were broken (``break_connections``), releasing all it held."""
    # lazy: torch, in rank processes only
    import torch.distributed as dist

    close_served_stores()
    kept = len(_ENDED_PROCESS_GROUPS)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - an aborted group may refuse; it is left behind either way
        _log.debug("the broken process group could not be destroyed; it is left behind", exc_info=True)
    # Unlike a launch's (keep_ended_process_groups), a group left here is broken first: no collective of it is
    # in flight, so its destructor has no worker to wait for. Released, a re-form leaks nothing (kept, each
    # cost rank 0 four threads and 14 descriptors).
    del _ENDED_PROCESS_GROUPS[kept:]
    gc.collect()
    secure_store.forget_clients()  # after the group that used them is gone


def _socket_inodes() -> dict[int, int]:
    """This process's open sockets: file descriptor -> inode."""
    found = {}
    for entry in os.listdir("/proc/self/fd"):
        try:
            status = os.stat(f"/proc/self/fd/{entry}")
        except OSError:
            _log.debug("descriptor %s cannot be stat'ed; not counted as a socket", entry, exc_info=True)
            continue
        if stat.S_ISSOCK(status.st_mode):
            found[int(entry)] = status.st_ino
    return found


# --- torch.distributed, as the user's code finds it ------------------------------------------------------


def replace_in_torch_distributed(name: str, wrap: Callable[[Any], Any]) -> None:
    """Replace ``torch.distributed.<name>`` (and ``distributed_c10d.<name>``, which torch's own code calls)
    with ``wrap(original)``, once per process: code that looks it up later, or unpickles a reference to it,
    gets the replacement."""
    # lazy: torch, in rank processes only
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original = getattr(distributed_c10d, name)
    if getattr(original, "_gpumagic_replaced", False):
        return
    replacement = functools.wraps(original)(wrap(original))
    replacement._gpumagic_replaced = True
    setattr(distributed_c10d, name, replacement)
    setattr(dist, name, replacement)


def keep_ended_process_groups() -> None:
    """``destroy_process_group`` in a rank keeps the groups it ends alive until the rank exits (``os._exit``:
    their destructors never run).

    torch 2.13 can deadlock when the last reference to a gloo group goes (pytorch PRs 180700, 182083): the
    group's destructor joins its worker threads while holding the GIL, and a worker still releasing a
    collective made in ``backward()`` waits for the GIL. The DDP tutorial's ``demo_basic`` (``cleanup()``,
    then ``return``: the DDP model's reducer holds the group's last reference) hung in 24 of 100
    ``gpumagic.spawn`` launches. Kept here, the group's last reference never goes while the rank runs.
    """
    # lazy: torch, in rank processes only
    from torch.distributed import distributed_c10d

    def wrap(original: Any) -> Any:
        def destroy_process_group(group: Any = None) -> None:
            if group is None or group == distributed_c10d.GroupMember.WORLD:
                _ENDED_PROCESS_GROUPS.extend(distributed_c10d._world.pg_map)
            else:
                _ENDED_PROCESS_GROUPS.append(group)
            return original(group)

        return destroy_process_group

    replace_in_torch_distributed("destroy_process_group", wrap)


def serve_the_users_own_group(files: RunFiles, place: StorePlace, rank: int, world_size: int, timeout_s: float) -> None:
    """Code that makes its own group (``spawn``) the torchrun way (``init_process_group(backend)``, env://) gets
    it on the launch's own store, which only the user's processes can reach, not on a TCPStore that answers
    anyone at MASTER_PORT. A group made again after ``destroy_process_group`` meets under a fresh prefix."""
    # lazy: torch, in rank processes only
    import torch.distributed as dist

    made = [0]
    unused_listener = [place.listener]

    def wrap(original: Any) -> Any:
        signature = inspect.signature(original)

        def init_process_group(*args: Any, **kwargs: Any) -> None:
            asked = signature.bind_partial(*args, **kwargs).arguments
            if asked.get("store") is not None or asked.get("init_method") not in (None, "env://"):
                return original(*args, **kwargs)  # the user's own rendezvous: theirs to secure
            own_rank = int(asked["rank"]) if asked.get("rank") not in (None, -1) else rank
            world = int(asked["world_size"]) if asked.get("world_size") not in (None, -1) else world_size
            timeout = asked.get("timeout")
            asked_timeout_s = timeout.total_seconds() if timeout is not None else timeout_s
            if made[0] == 0:
                store = group_store(files, replace(place, listener=unused_listener[0]), own_rank, asked_timeout_s)
                unused_listener[0] = None
                _USERS_STORE[:] = [store]
            elif own_rank == 0:
                store = _USERS_STORE[0]
            else:
                store = group_store(files, replace(place, listener=None), own_rank, asked_timeout_s)
            made[0] += 1
            asked.pop("init_method", None)
            asked.update(store=dist.PrefixStore(f"gpumagic-init-{made[0]}", store), rank=own_rank, world_size=world)
            return original(**asked)

        return init_process_group

    replace_in_torch_distributed("init_process_group", wrap)


class ProcessGroupExists(RuntimeError):
    """The user's code asked for a process group other than the one the launch made."""


def accept_the_users_own_set_up(backend: str, world_size: int, rank: int, made_by: str = "%%launch_ddp") -> None:
    """Let code written for torchrun (``init_process_group(...)`` first thing, as pytorch/examples' multigpu.py)
    run unchanged: a call asking for the group the launch made does nothing, with one line from rank 0; a call
    asking for another group fails in one line that says what to change."""
    # lazy: torch, in rank processes only
    import torch.distributed as dist

    def wrap(original: Any) -> Any:
        signature = inspect.signature(original)

        def init_process_group(*args: Any, **kwargs: Any) -> None:
            if not dist.is_initialized():  # the user destroyed ours first: theirs is theirs
                return original(*args, **kwargs)
            asked = signature.bind_partial(*args, **kwargs).arguments
            asked_backend = str(asked.get("backend") or backend).lower()
            asked_world = int(asked.get("world_size", -1) if asked.get("world_size") is not None else -1)
            asked_rank = int(asked.get("rank", -1) if asked.get("rank") is not None else -1)
            same = (
                backend in asked_backend.replace(",", ":").split(":")
                and asked_world in (-1, world_size)
                and asked_rank in (-1, rank)
            )
            made = f"{backend}, {world_size} rank{'s' if world_size != 1 else ''}"
            if not same:
                wanted = ", ".join(f"{k}={v!r}" for k, v in asked.items() if k in ("backend", "world_size", "rank"))
                raise ProcessGroupExists(
                    f"init_process_group({wanted}): {made_by} made the process group already ({made}, this is rank "
                    f"{rank}); remove the call, or launch with the backend (--backend) and number of ranks (-n) it "
                    "asks for"
                )
            if rank == 0:
                print(
                    f"[gpumagic] init_process_group: {made_by} made the process group already ({made}); "
                    "the call does nothing",
                    file=sys.stderr,
                )
            return None

        return init_process_group

    replace_in_torch_distributed("init_process_group", wrap)
