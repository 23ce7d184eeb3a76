"""SIGTERM and SIGHUP handled as Ctrl-C: one home for how a task ends on a signal (exit 130, said, no traceback)."""

from __future__ import annotations

import contextlib
import signal


def terminate_as_interrupt():
    """Context manager: SIGTERM and SIGHUP raise KeyboardInterrupt (once) in the main thread, so a task
    stopped by ``timeout``, ``kill``, Kubernetes, a CI runner or a closed terminal cleans up as Ctrl-C does; later
    signals are ignored until the block ends (the clean-up is not interrupted). Does nothing outside the main thread.
    Every Invoke task runs inside it (``tasks.guarded``: a build stopped with SIGTERM exits 130 and says so, hostile
    s12 F-I); ``serving.rollout`` enters it too for callers outside a task.

    A signal that arrives while tritonclient.http waits in gevent's hub (a smoke request, a probe) raises in the
    hub's loop: gevent prints every error there with a traceback before it throws a ``SYSTEM_ERROR``
    (KeyboardInterrupt) into the main greenlet (gevent/hub.py ``Hub.handle_error``). Inside the block
    KeyboardInterrupt counts as one of the hub's ``NOT_ERROR`` (not printed; still thrown on), so the
    interruption is reported once, by the task, without a traceback (hostile s7 #109)."""
    import threading

    @contextlib.contextmanager
    def cm():
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        fired = []

        def handler(signum, frame):
            if fired:
                return
            fired.append(signum)
            raise KeyboardInterrupt(signal.Signals(signum).name)

        try:
            from gevent.hub import Hub
        except ImportError:  # no tritonclient.http installed: nothing waits in a hub
            Hub = None  # noqa: N806
        not_error = Hub.NOT_ERROR if Hub is not None else ()
        old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
        if Hub is not None:
            Hub.NOT_ERROR = (*not_error, KeyboardInterrupt)
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            if Hub is not None:
                Hub.NOT_ERROR = not_error
    return cm()


__all__ = ["terminate_as_interrupt"]
