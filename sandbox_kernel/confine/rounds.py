"""One round of a single-threaded select loop (the fork server's and the companion's).

Each registration's data is its callback, called with the registration's file object. A
callback may close descriptors and register new ones; a new one takes the lowest free number,
which can be one that is still in this round's ready list. That event was the old
descriptor's: its callback, or the new registration's, would act on the wrong thing (the
companion blocked in a seccomp receive no call is waiting for; the server reaping a process
twice and ending on the KeyError). So an event whose registration changed earlier in the
round is left out; the next select reports the registration as it is now (level-triggered).
"""

from __future__ import annotations

import selectors


def run_round(selector: selectors.BaseSelector, timeout: float | None) -> None:
    """One select, and each ready registration's callback that is still its own."""
    for key, _ in selector.select(timeout):
        if selector.get_map().get(key.fd) is key:  # unregistered, replaced or modified: stale
            key.data(key.fileobj)
