"""A launch that runs on a thread of the kernel while the notebook goes on: ``spawn(..., join=False)`` and
``%%launch_ddp --no-wait`` both return, or keep, one ``LaunchHandle``."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

_log = logging.getLogger(__name__)

Outcome = Any  # ``{rank: value}``, or the exception the launch raised


class LaunchHandle:
    """Ranks running in the background: ``join()`` gives ``{rank: value}`` or raises the launch's error.

    ``on_end`` is told the outcome (the results, or the exception) on the launch's thread as soon as the launch
    ends, before ``join`` returns: ``%%launch_ddp --no-wait`` sets its ``-o VAR`` there. Every exception is
    an outcome, ``KeyboardInterrupt`` and ``SystemExit`` too, so nothing a launch raises is lost on its thread.

    >>> handle = LaunchHandle(lambda: {0: "done"}).start()
    >>> handle.join(10)
    {0: 'done'}
    """

    def __init__(
        self,
        run: Callable[[], dict[int, Any]],
        on_end: Callable[[Outcome], None] | None = None,
        name: str = "gpumagic-launch",
    ) -> None:
        self._run = run
        self._on_end = on_end
        self._result: dict[int, Any] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._target, name=name, daemon=True)

    def start(self) -> LaunchHandle:
        """Start the launch on its thread; returns this handle."""
        self._thread.start()
        return self

    def _target(self) -> None:
        outcome: Outcome
        try:
            outcome = self._result = self._run()
        except BaseException as err:  # noqa: BLE001 - handed to on_end and join()
            _log.debug("the launch on its thread failed; the error goes to join() and on_end", exc_info=True)
            outcome = self._error = err
        if self._on_end is not None:
            self._on_end(outcome)

    def done(self) -> bool:
        """Whether the launch has ended (and ``on_end`` was told)."""
        return self._thread.ident is not None and not self._thread.is_alive()

    def join(self, timeout: float | None = None) -> dict[int, Any] | None:
        """Wait for the ranks (``timeout`` seconds at most); their ``{rank: value}``, or ``None`` if the timeout
        passed first.

        Raises:
            the launch's own error (``LaunchError``, ``LaunchInterrupted``, ``InvalidArgument``, ...).
        """
        self._thread.join(timeout)
        if self._thread.is_alive():
            return None
        if self._error is not None:
            raise self._error
        return self._result
