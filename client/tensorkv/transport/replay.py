"""The pushes a worker keeps, per server, to send again: :class:`PushLog` (after ps-lite's
``Resender``, src/resender.h: ``AddOutgoing`` keeps what was sent, the acknowledgement drops it).

Two kinds are kept. A push sent without waiting for its answer (on a Session's data channel)
is kept from :meth:`PushLog.sent` until :meth:`PushLog.answered` (or :meth:`PushLog.failed`),
to send again on a new connection when its answer was lost with the old one. Where a worker
realigns after a server restart (sync mode, several workers, snapshots: see
:class:`tensorkv.transport.server_conn.ServerConn`), a copy of each push is kept too (:meth:`PushLog.keep`),
trimmed as pulls show the rounds of the pushes complete (:meth:`PushLog.seen_complete`).
"""
from ..errors import key_repr
from ..v1 import kvstore_pb2
from ..wire.codec import Item, StreamDecoder
from ..words import plural

KEPT_PUSHES = 8  # copies kept per key at most, where a worker realigns (PushLog.keep)


class PushLog:
    """The pushes of one worker to the server at ``address`` that may have to be sent again."""

    def __init__(self, address):
        self.address = address
        self.realign = False  # whether a restart needs the last pushes again (sync, several workers, snapshots)
        # key -> [(sequence number, a copy of a push to it: an Item, or row-sparse (key, shape,
        # row ids, rows))]: its last push whose round this worker saw complete (a pull of the key
        # answered after it), and those after it, where it realigns
        self.kept = {}
        self._seen = {}  # key -> the sequence number of its kept push whose round was seen complete
        # sequence number -> the serialized request of a push sent without waiting (or, packed, its
        # layout and values; or its own Items), until its answer came
        self._unacked = {}
        self._undos = {}  # sequence number -> what to run should that push fail

    @property
    def unacked(self):
        """Whether pushes sent without waiting have no answer yet."""
        return bool(self._unacked)

    def sent(self, sequence, request, undo=None):
        """The push ``sequence`` was sent without waiting (``request``: what sends it again,
        see :func:`pushed_items`): keep it, and ``undo``, until its answer comes."""
        self._unacked[sequence] = request
        if undo is not None:
            self._undos[sequence] = undo

    def answered(self, sequence):
        """The push ``sequence``, sent without waiting, succeeded."""
        self._unacked.pop(sequence, None)
        self._undos.pop(sequence, None)

    def failed(self, sequence, keys, error):
        """The error to raise for the push ``sequence`` of ``keys``, sent without waiting, which
        failed with ``error`` (its undo run); it is no longer to be sent again."""
        self._unacked.pop(sequence, None)
        for key in keys:  # it changed nothing: a restart must not send it again
            kept = self.kept.get(key, [])
            kept[:] = [entry for entry in kept if entry[0] != sequence]
        undo = self._undos.pop(sequence, None)
        if undo is not None:
            undo()
        named = ", ".join(key_repr(key) for key in keys[:5]) + (", ..." if len(keys) > 5 else "")
        return type(error)(f"an earlier push of {plural(len(keys), 'key')} ({named}) to server {self.address}, sent "
                           f"without waiting for its answer, failed and changed nothing: {error}")

    def waits_for(self, sequence):
        """Whether the push ``sequence`` was sent without waiting and has no answer yet."""
        return sequence in self._unacked

    def copies(self, part):
        """[(key, a copy of its Item)] of ``part`` to keep where this worker realigns."""
        if not self.realign:
            return []
        return [(item.key, Item(item.key, item.array if item.owned else item.array.copy(), item.shape, item.slice,
                                two_bit=item.two_bit))
                for _, item in part]

    def keep(self, copies, sequence):
        """Keep ``copies`` [(key, value)] of the push ``sequence``, after what is kept of each key."""
        for key, value in copies:
            kept = self.kept.setdefault(key, [])
            kept.append((sequence, value))
            del kept[:-KEPT_PUSHES]

    def seen_complete(self, keys, issued):
        """A pull of ``keys`` answered, after this worker's calls up to the sequence number
        ``issued``: the rounds of its pushes to them are complete; of those, only the last is
        kept."""
        if not self.kept:  # nothing is kept where this worker does not realign
            return
        for key in keys:
            kept = self.kept.get(key, [])
            seen = [index for index, (sequence, _) in enumerate(kept) if sequence <= issued]
            if seen:
                del kept[:seen[-1]]
                self._seen[key] = kept[0][0]

    def discarded(self, keys, issued):
        """A pull of ``keys`` raised RoundAbortedError: the last push to each, sent before the
        call ``issued`` and not seen complete, was discarded with its round; a restart must
        not send it again."""
        for key in keys:
            kept = self.kept.get(key, [])
            unseen = [index for index, (sequence, _) in enumerate(kept)
                      if sequence <= issued and sequence != self._seen.get(key)]
            if unseen:
                del kept[unseen[-1]]

    def to_send_again(self, restarted):
        """[(sequence number, its values: Items, or row-sparse (key, shape, row ids, rows))] in
        order: the pushes sent without waiting whose answers did not come, and after a restart
        the pushes kept of each key."""
        calls = {}
        if restarted:
            for kept in list(self.kept.values()):
                for sequence, value in list(kept):
                    calls.setdefault(sequence, []).append(value)
        calls.update((sequence, pushed_items(request)) for sequence, request in self._unacked.items())
        return sorted(calls.items())


def pushed_items(request):
    """The Items of a push sent without waiting: of the serialized SessionRequest ``request``
    whose values all travel in it, of the (packed.Layout, packed values) it moved, or the
    push's own Items whose values followed it."""
    if isinstance(request, list):
        return request
    if isinstance(request, tuple):
        layout, values = request
        return [Item(key, value) for key, value in zip(layout.keys, layout.views(values))]
    decoder = StreamDecoder(kvstore_pb2.SessionRequest, "frame", two_bit=True)
    decoder.feed(request)
    return decoder.finish()
