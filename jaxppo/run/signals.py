"""SIGINT and SIGTERM during a run: stop after the running chunk with everything saved, and
at once on a second signal (`StopSignals`).

The command line enters one around the whole run; the run loop (jaxppo.run.loop) joins it,
or installs its own for a library call.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import threading
from typing import Any

from jaxppo.run.folder import RunFolder


class StopSignals:
    """SIGINT and SIGTERM during a run: stop after the running chunk, with everything saved.

    While active (a context manager, in the main thread) the signals do not kill the process.
    A watcher thread reads them through `signal.set_wakeup_fd`, so they are answered at once
    even while a chunk runs inside XLA. The first is acknowledged on stderr and recorded: the
    run loop stops after the running chunk and checkpoints. A second one stops at once: on
    the command line (exit_at_once) the process ends with the shell's code for that signal
    (130 for SIGINT) as soon as no file of the run folder is being written, the folder
    holding the last chunk's metrics and its last complete checkpoint; in a library call,
    KeyboardInterrupt is raised when Python next runs in the main thread.

    The command line enters one around the whole run (`exit_at_once=True`): a signal before
    training starts (while compiling) ends the process at once, and the loop's own
    `StopSignals.during_loop` joins it instead of installing another.
    """

    _active: StopSignals | None = None

    def __init__(self, exit_at_once: bool = False, command: str = "jaxppo train"):
        self.exit_at_once, self.command = exit_at_once, command
        self.received: str | None = None
        self.phase = "before"  # "before" the loop, in the "loop", "after" it (finishing)
        self.writing = threading.Lock()  # held while the loop writes to the run folder
        self.folder: RunFolder | None = None
        self.saver: Any = None  # the loop's checkpoint cadence: saved_at, the newest checkpoint
        self.rows_done: int | None = None
        self.final_chunk = False  # the running chunk is the loop's last
        self.num_iterations = 0
        self._raise = False
        self._lock = threading.RLock()
        self._previous: dict = {}
        self._socks = self._watcher = None
        self._previous_fd = -1

    @classmethod
    @contextlib.contextmanager
    def during_loop(cls, folder: RunFolder | None, saver: Any, num_iterations: int):
        """The run loop's signals: the command line's StopSignals when one is active, else
        a library call's own (installed for the loop only)."""
        outer = cls._active
        signals = outer if outer is not None else cls()
        with contextlib.nullcontext(signals) if outer is not None else signals:
            with signals._lock:
                signals.folder, signals.saver = folder, saver
                signals.num_iterations, signals.phase = num_iterations, "loop"
            try:
                yield signals
            finally:
                signals.phase = "after"

    @classmethod
    def holding_writes(cls):
        """A context for writing run-folder files outside the loop: on the command line, a
        second signal waits for them (a library call's signals do not)."""
        outer = cls._active
        return outer.writing if outer is not None else contextlib.nullcontext()

    def stopping(self) -> bool:
        """Whether a signal asked the loop to stop (signals not yet seen by the watcher are
        read first, so one sent a moment ago counts)."""
        self._drain()
        return self.received is not None

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        self._socks = socket.socketpair()
        for s in self._socks:
            s.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._socks[1].fileno(),
                                                 warn_on_full_buffer=False)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        self._watcher = threading.Thread(target=self._watch, name="jaxppo-signals", daemon=True)
        self._watcher.start()
        if self.exit_at_once:
            StopSignals._active = self
        return self

    def __exit__(self, *exc):
        if self._socks is None:
            return False
        if StopSignals._active is self:
            StopSignals._active = None
        self._drain()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_fd)
        self._socks[1].close()  # the watcher reads the end of the stream and returns
        self._watcher.join(timeout=5)
        self._socks[0].close()
        return False

    def _handle(self, signum, frame):
        """The main thread's handler. A library call's second signal raises here; on the
        command line the watcher thread (or `stopping`) acts, never code interrupted midway
        through a write."""
        if not self.exit_at_once:
            self._drain()
            if self._raise:
                self._raise = False
                raise KeyboardInterrupt

    def _watch(self) -> None:
        sock = self._socks[0]
        while True:
            try:
                select.select([sock], [], [])
            except (OSError, ValueError):
                return
            if not self._drain():
                return

    def _drain(self) -> bool:
        """Act on every signal number waiting in the wakeup socket; False once it is closed."""
        with self._lock:
            if self._socks is None:
                return False
            while True:
                try:
                    data = self._socks[0].recv(64)
                except BlockingIOError:
                    return True
                except OSError:
                    return False
                if not data:
                    return False
                for signum in data:
                    self._on_signal(signal.Signals(signum).name)

    def _on_signal(self, name: str) -> None:
        if self.exit_at_once and self.phase == "before":
            _exit(name, f"{name} stopped jaxppo before training started; nothing was saved")
        if self.received is not None:  # the second: stop at once
            if self.exit_at_once:
                self._exit_now(name)
            self._raise = True
            return
        self.received = name
        if self.phase == "loop":
            then = ("Ctrl-C again to stop at once (the run folder keeps its last checkpoint)"
                    if self.exit_at_once else "Ctrl-C again to stop without saving")
            what = ("the running chunk is the last one: training ends with it and saves as usual"
                    if self.final_chunk else
                    "training stops after the running chunk and saves a checkpoint")
            print(f"\n{name}: {what}; {then}", file=sys.stderr, flush=True)
        else:
            print(f"\n{name}: the last chunk is done; writing the run folder's final files (a "
                  "moment); Ctrl-C again to stop at once", file=sys.stderr, flush=True)

    def _exit_now(self, name: str) -> None:
        """End the process once no file of the run folder is being written and the last
        checkpoint is complete, saying what the folder holds."""
        self.writing.acquire()  # waits for a write in progress; never released
        folder, saver = self.folder, self.saver
        if folder is None:
            _exit(name, f"{name} stopped training at once; no run folder was given, so nothing "
                        "was saved")
        # A checkpoint being written completes; if it fails, the ones before it stand.
        with contextlib.suppress(Exception):
            if folder.store is not None:
                folder.store.wait()
        saved = saver.saved_at if saver is not None else None
        rows = (f"; metrics.jsonl has iterations 1 to {self.rows_done} (a resume cuts it back to "
                f"{saved})" if self.rows_done and saved is not None and self.rows_done > saved
                else "")
        if saved:
            _exit(name, f"Second {name}: stopped at once. {folder.path} keeps the checkpoint of "
                        f"iteration {saved} of {self.num_iterations}{rows}; continue with: "
                        f"{self.command} --resume {folder.path}")
        _exit(name, f"Second {name}: stopped at once, before the first checkpoint was saved, so "
                    f"{folder.path} holds nothing to resume from (only the metrics of the "
                    "iterations so far); start the run again")


def _exit(name: str, message: str) -> None:
    """Print `message` and end the process now with the shell's code for signal `name`."""
    print(f"\n{message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(128 + int(getattr(signal, name)))
