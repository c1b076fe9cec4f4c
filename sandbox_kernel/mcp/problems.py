"""Hosting's refusals said to a model: the one place the MCP server words them.

Sessions, pausing and the snapshot store are hosting's (hosting/sessions.py, pausing.py,
store.py), shared with the HTTP service; their errors carry the service's wording and an HTTP
status, plus a `reason` and the facts it names. A model gets none of the service's words: this
module turns each reason into what happened and what the model can do with its tools, never an
operator's flag (the operator's wording goes to the log).
"""

from __future__ import annotations

import logging

from ..hosting.network import policy_name
from ..hosting.sessions import SessionError
from ..hosting.store import HeldElsewhere, QuotaError, SizeError, StoreError, UnknownSnapshot

log = logging.getLogger("sandbox_kernel.mcp")


class SessionProblem(Exception):
    """A request a model can act on that cannot be carried out; the message is for it."""


def for_model(refused: SessionError | StoreError) -> str:
    """What a model is told of a refusal of hosting's."""
    log.info("refused: %s", refused)  # the operator's wording, with the setting
    if isinstance(refused, SessionError):
        return _session(refused)
    return _store(refused)


def _session(refused: SessionError) -> str:
    facts = refused.facts
    session = facts.get("session")
    if refused.reason == "unknown":
        return (f"there is no session {session!r}: create one with create_session, or see "
                "yours with list_sessions")
    if refused.reason == "busy":
        doing = facts.get("run") or "a file operation"
        return f"session {session} is running {doing}: wait for it (wait_run) or interrupt it first"
    if refused.reason == "pausing":
        return f"session {session} is being paused: call again in a moment, which resumes it"
    if refused.reason == "gone":
        return (f"session {session}'s sandbox is gone ({facts.get('why')}): close it "
                "(close_session) and create a new one")
    if refused.reason == "key_limit":
        paused = " (paused ones count)" if facts.get("paused") else ""
        return (f"you may hold {facts['limit']} sessions at once{paused}: close one you no "
                "longer need (close_session), or run without a session")
    if refused.reason == "service_full":
        return (f"this server already holds its {facts['limit']} sessions: close one you no "
                "longer need (close_session)")
    if refused.reason == "restore_refused":
        return f"the snapshot could not be restored: {facts.get('why')}"
    if refused.reason == "holds_secrets":
        return (f"session {session} holds secrets of your own, which are never written to "
                "disk: it is not paused (snapshot it and create a session from the snapshot "
                "with the secrets again)")
    if refused.reason == "other_network":
        name = policy_name(facts["network"])
        made = {"offline": "off", "network": "on"}.get(name, "limited to some hosts")
        return (f"snapshot {facts['snapshot']} was made with the network {made}: a session "
                "opened from it gets the same (omit network)")
    if refused.reason == "other_runtime":
        return (f"snapshot {facts['snapshot']} was made on another Python runtime than this "
                "server's: it cannot be opened here")
    return str(refused)


def _store(refused: StoreError) -> str:
    kept = "Nothing was saved and the session goes on as it was."
    if isinstance(refused, UnknownSnapshot):
        return (f"there is no snapshot {refused.snapshot_id!r}: see yours with "
                "list_snapshots")
    if isinstance(refused, HeldElsewhere):
        return (f"session {refused.session_id} is being resumed by another server sharing "
                "this one's snapshots, or runs there now: call again in a few seconds (it "
                "then runs there, not here)")
    if isinstance(refused, SizeError):
        return (f"The session's state is {refused.size} bytes, more than the "
                f"{refused.limit} bytes a snapshot may have on this server. {kept} Free large "
                "variables or files (del name; remove files) and snapshot again.")
    if not isinstance(refused, QuotaError):
        return str(refused)
    if refused.reason == "key_count":
        held = f"You keep {refused.held} snapshots, the most this server allows you."
    else:
        held = (f"Your snapshots hold {refused.held} bytes and this one does not fit in the "
                f"{refused.limit} bytes this server allows you.")
    return (f"{held} {kept} Delete snapshots you no longer need (list_snapshots, then "
            "delete_snapshot) and snapshot again.")
