"""A rank whose peer died: the communication backend's error says only that a connection broke.

When one rank of a run dies (a crash, a SIGKILL, the out-of-memory killer), the ranks still waiting on it
fail inside a collective or a pipeline send / receive with the backend's own error (gloo: "Read error
[127.0.0.1]:50102: Connection reset by peer", with a traceback through torch's schedules). That is a
consequence, not a cause: the surviving rank says so in one line and leaves the cause to the rank that
failed first, which the launcher names.
"""
from __future__ import annotations

PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
             "remote process exited or there was a network error")
"""How gloo and NCCL word a connection to a peer process that went away."""


def peer_lost(error: BaseException) -> str | None:
    """One line for a rank whose peer process died, from the backend's error; None for any other error."""
    if not isinstance(error, RuntimeError):
        return None
    text = str(error)
    reason = next((phrase for phrase in PEER_LOST if phrase in text), None)
    if reason is None:
        return None
    return (f"another rank of this run died ({reason}: the communication backend lost its connection to it), so "
            f"this rank stops too; the cause is that rank's failure, which the launcher names (the rank that failed "
            f"first)")
