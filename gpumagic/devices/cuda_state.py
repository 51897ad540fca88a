"""Whether CUDA has started in this process, found out without starting it.

CUDA reads ``CUDA_VISIBLE_DEVICES`` once, in the driver's ``cuInit``. Loading the driver library is not
starting it: on real drivers ``nvmlInit()`` loads ``libcuda.so.1`` (so does importing a CUDA build of torch),
yet ``cuInit`` has not run and the kernel can still choose its GPUs. The loaded driver answers the question
itself: a driver call made before ``cuInit`` returns ``CUDA_ERROR_NOT_INITIALIZED``. It is asked through
``dlopen(RTLD_NOLOAD)``, which never loads a library that is not loaded already.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

_log = logging.getLogger(__name__)

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_STUB_LIBRARY = 34  # the toolkit's link-time stub: it never starts anything
_NOT_STARTED = (CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_STUB_LIBRARY)
_started: str | None = None  # cuInit cannot be undone: once seen, the answer stays


def cuda_initialized() -> str | None:
    """Why CUDA can no longer change its devices in this process, or ``None`` if it still can.

    Never initializes CUDA and never loads the driver: it asks torch only if torch is already imported, and
    asks the driver only if this process has loaded it.
    """
    global _started
    if _started is not None:
        return _started
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                return "torch has initialized CUDA in this kernel"
        except Exception:  # noqa: BLE001 - a half-imported torch must not break %gpu
            _log.debug("torch cannot say if CUDA is initialized; the loaded driver is asked", exc_info=True)
    for path in loaded_drivers():
        code = driver_status(path)
        if code is None or code in _NOT_STARTED:
            continue
        if code == CUDA_SUCCESS:
            _started = "CUDA has started in this kernel (torch.cuda.is_available() or another CUDA call started it)"
        else:
            _started = f"CUDA's start in this kernel failed (CUDA error {code}) and CUDA does not start twice"
        return _started
    return None


def loaded_drivers() -> list[str]:
    """The CUDA driver libraries (``libcuda.so*``) this process has loaded, as ``/proc/self/maps`` names them."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            lines = maps.read().splitlines()
    except OSError:  # not Linux
        _log.debug("/proc/self/maps is unreadable; no CUDA driver counted as loaded", exc_info=True)
        return []
    paths: dict[str, None] = {}
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and os.path.basename(fields[5]).startswith(b"libcuda.so"):
            paths[os.fsdecode(fields[5])] = None
    return list(paths)


def driver_status(path: str) -> int | None:
    """What the loaded driver at ``path`` answers to ``cuDeviceGetCount`` (``CUDA_ERROR_NOT_INITIALIZED`` before
    ``cuInit``), or ``None`` when it cannot be asked (not loaded after all, or no such entry point)."""
    try:
        driver = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        device_count = driver.cuDeviceGetCount
    except (OSError, AttributeError):
        _log.debug("the loaded driver %s cannot be asked; its state is taken as unknown", path, exc_info=True)
        return None
    count = ctypes.c_int(0)
    return int(device_count(ctypes.byref(count)))
