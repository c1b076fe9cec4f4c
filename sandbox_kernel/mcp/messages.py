"""What a model is told: refusals, timeouts and limits said as what happened and what to do.

The sandbox's own messages are addressed to whoever runs it ("install with --allow-network").
A model cannot change flags; it can change its code. Refusals keep one text per rule in
`confine.denials` (`Rule.why` for the operator, `Rule.for_model` for a model): here the error's
operator text is found and replaced, and the operator's text goes to the server's log.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from ..client import ErrorInfo, Execution
from ..confine import denials
from ..errors import ExecutionTimeout, KernelDied, MessageTooLarge, ResultTooLarge

log = logging.getLogger("sandbox_kernel.mcp")

# The markers the kernel's and the client's output caps leave in stderr (kernel/output.py,
# client/receive.py): both name flags, so a model sees its own form instead.
_CAP_MARKER = re.compile(r"\n?\[sandbox-kernel(?: client)?: [^\]\n]*limit[^\]\n]*\]\n?")
OUTPUT_CUT = ("\n[output cut: this sandbox keeps a limited amount of output per run; print "
              "less, or write large output to a file and read the part you need]\n")


@dataclass
class Said:
    """An error as a model reads it: the message (without the name, as an exception's value:
    whoever shows it puts the name before it once), and the traceback with the same wording."""

    name: str
    message: str
    traceback: list[str]
    refused: bool = False


def _refusal(error: ErrorInfo) -> Said | None:
    rule = denials.rule_in(error.value)
    if rule is None:
        return None
    log.info("refused %s: %s", error.name, error.value)  # the operator's fix, for the log

    def plain(text: str) -> str:
        at = text.find(rule.why)
        return text if at < 0 else text[:at] + rule.for_model

    return Said(error.name, plain(error.value), [plain(line) for line in error.traceback],
                refused=True)


# Without the network a name lookup fails before any socket is refused: the resolver's own
# words ("Temporary failure in name resolution") would send a model into retrying.
_LOOKUP_FAILED = re.compile(r"name resolution|Name or service not known|"
                            r"No address associated with hostname|nodename nor servname")


def _offline_lookup(error: ErrorInfo) -> Said | None:
    if not _LOOKUP_FAILED.search(error.value):
        return None
    said = denials.NETWORK_OFF.for_model
    return Said(error.name, said, [*error.traceback[:-1], f"{error.name}: {said}"], refused=True)


def _timeout(error: ErrorInfo, timeout: float | None, scope: str) -> str:
    limit = f"its {timeout:g} s" if timeout else "its"
    kept = {"session": " The session's variables and imports are kept.",
            "lost": " The session had to be restarted: its variables and imports are gone, so "
                    "run your set-up code again.",
            "fresh": ""}[scope]
    return (f"the code ran past {limit} time limit and was stopped.{kept} Make it faster or "
            "work on less data, or call again with a larger timeout.")


def for_model(execution: Execution, timeout: float | None, in_session: bool,
              memory_limit: int, network: bool = False) -> Said | None:
    """The execution's error as a model should read it (None: no error)."""
    error = execution.error
    if error is None:
        return None
    said = _refusal(error) or (None if network else _offline_lookup(error))
    if said is not None:
        return said
    scope = "lost" if execution.state_lost and in_session else \
        "session" if in_session else "fresh"
    message = {
        ExecutionTimeout.code: lambda: _timeout(error, timeout, scope),
        "KeyboardInterrupt": lambda: "the run was interrupted." + (
            " The session's variables are kept." if scope == "session" else ""),
        "MemoryError": lambda: "the code ran out of memory" + (
            f" (this sandbox allows {memory_limit / 2**20:,.0f} MiB)" if memory_limit else "")
            + ": process the data in smaller pieces or use less memory.",
        KernelDied.code: lambda: "the Python process running the code died (it may have run out "
            "of memory or crashed)." + (" The session was restarted: its variables and imports "
                                        "are gone, so run your set-up code again."
                                        if in_session else ""),
        "PackageInstallError": lambda: "the package could not be installed in this "
            "sandbox: use the packages that are installed (the sandbox://policy resource lists "
            "them).",
        ResultTooLarge.code: lambda: "the result was too large to return: return a summary, or "
            "write the data to a file and read the part you need.",
        MessageTooLarge.code: lambda: "the code produced a message too large to return (a huge "
            "result or display): return a summary, or write the data to a file."
            + (" The session was restarted: its variables are gone." if in_session else ""),
    }.get(error.name)
    if message is None:
        return Said(error.name, error.value, list(error.traceback))
    text = message()
    log.info("%s: %s", error.name, error.value)  # the operator's wording, for the log
    return Said(error.name, text, [*error.traceback[:-1], f"{error.name}: {text}"]
                if error.traceback else [f"{error.name}: {text}"])


def plain_output(text: str) -> str:
    """Stream text with the caps' operator markers said for a model."""
    return _CAP_MARKER.sub(OUTPUT_CUT, text)


def cut(text: str, limit: int) -> str:
    """At most about `limit` characters: the head and the tail, with what was cut said."""
    if limit <= 0 or len(text) <= limit:
        return text
    head, tail = text[: limit * 2 // 3], text[-(limit // 3):]
    middle = len(text) - len(head) - len(tail)
    return (f"{head}\n[... {middle:,} characters cut here: print less, or write large output "
            f"to a file and read the part you need ...]\n{tail}")


NO_NETWORK_SESSION = ("the network is off on this server: sessions cannot have network access; "
                      "use the files and data you were given")
