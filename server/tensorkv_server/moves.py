"""A server's part in a move of its run to other servers (``tensorkv reshard``): the RunMove
of protos/tensorkv/v1/kvstore.proto, kept by the Coordinator and in snapshots.

A *source* whose move is not done is frozen: no worker registers, nothing changes, so that
what the tool reads is one state. Once the move is done it refuses workers with a message
naming the servers the run went to. A *target* refuses workers until the tool commits it.
"""
from tensorkv.errors import FailedPreconditionError

SOURCE, TARGET = "source", "target"


class Move:
    """``role`` SOURCE or TARGET, ``servers`` (host:port, the other side), ``done``."""

    __slots__ = ("role", "servers", "done")

    def __init__(self, role, servers, done=False):
        self.role, self.servers, self.done = role, list(servers), done

    def __repr__(self):  # a snapshot's _stamp compares it
        return f"Move({self.role!r}, {self.servers!r}, {self.done!r})"

    @property
    def frozen(self):
        """Whether the run must not change: a source, or a target not committed yet."""
        return self.role == SOURCE or not self.done

    def to_header(self):
        return {"role": self.role, "servers": self.servers, "done": self.done}

    @classmethod
    def from_header(cls, entry):
        """The Move of a snapshot header's "moved" (None: none)."""
        if entry is None:
            return None
        if entry["role"] not in (SOURCE, TARGET) or not isinstance(entry["done"], bool):
            raise ValueError(f"moved is {entry!r}")
        return cls(entry["role"], [str(server) for server in entry["servers"]], entry["done"])

    def words(self):
        """What the move is, for messages: 'moved to A,B', 'being moved to ...', ..."""
        servers = ",".join(self.servers)
        if self.role == SOURCE:
            return f"moved to {servers}" if self.done else f"being moved to {servers}"
        return f"moved here from {servers}" if self.done else f"being moved here from {servers}"

    def check_register(self, run):
        """FailedPreconditionError for a worker's registration on a server in this move."""
        if not self.frozen:
            return
        job = f" (job {run.job!r})" if run is not None and run.job else ""
        servers = ",".join(self.servers)
        if self.role == SOURCE and self.done:
            raise FailedPreconditionError(
                f"the run on this server{job} moved to {servers} (tensorkv reshard): start the job's workers with "
                f"TENSORKV_SERVERS={servers} and if_exists='resume' (TENSORKV_IF_EXISTS=resume)")
        raise FailedPreconditionError(
            f"the run on this server{job} is {self.words()} by `tensorkv reshard`, which refuses workers meanwhile: "
            f"run that command again to complete the move, then start the workers on the new servers")


def check_changeable(move, what):
    """FailedPreconditionError when ``move`` (None: none) freezes the server's state, for a call
    that would change it (``what``: 'a reset', ...)."""
    if move is not None and move.frozen:
        raise FailedPreconditionError(
            f"{what} would change this server's state, which is frozen: its run is {move.words()} by `tensorkv "
            "reshard`; run that command again to complete the move")
