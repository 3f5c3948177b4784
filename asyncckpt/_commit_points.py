"""Named points of the commit protocol, where crash tests stop a real process.

The worker calls :func:`reached` at each point a SIGKILL could leave a different set of files
behind (``docs/format.md``, "Commit protocol"). In production no hook is set and it costs a
global read. ``tests/test_commit_points.py`` sets one in a child process that SIGKILLs itself
at a chosen point, to check that every such state reads back consistently.
"""

from __future__ import annotations

from collections.abc import Callable

POINTS = (
    "tmp-created",  # the .tmp-* directory exists, empty
    "data-written",  # data file written and fsynced, no manifest
    "manifest-written",  # manifest written and fsynced; not yet visible
    "marker-written",  # the .committing-* marker exists; not yet visible
    "renamed",  # step-N visible, latest one behind; the run directory not yet fsynced (a failure here is that fsync's)
    "pointer-temp-written",  # .latest.* temporary written, latest unchanged
    "pointer-replaced",  # latest names the new step; the marker is still there
    "committed",  # marker gone; retention not yet run
    "retention-moved-aside",  # an old checkpoint renamed to .deleting-*, not yet removed
)
"""In the order a save reaches them."""

_hook: Callable[[str], None] | None = None


def set_hook(hook: Callable[[str], None] | None) -> None:
    """Call ``hook(point)`` at every point reached from now on, in this process (None: stop)."""
    global _hook
    _hook = hook


def reached(point: str) -> None:
    """Worker thread: the save has reached ``point`` (one of :data:`POINTS`)."""
    hook = _hook
    if hook is not None:
        hook(point)
