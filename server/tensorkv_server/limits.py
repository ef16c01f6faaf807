"""The server's resource limits, their flags and their defaults.

The codec checks each request against them as it decodes it, before it allocates anything
for a value (:class:`tensorkv.wire.decoding.FrameDecoder`); the coordinator checks ``--max-memory``
before it stores a value or installs an optimizer. A request over a limit is refused
whole, with a message naming the limit, its value and its flag.
"""
import dataclasses
import os

from tensorkv.wire.allocator import SERVER_TRIM_THRESHOLD
from tensorkv.words import plural, size

from .budget import WAIT as BUDGET_WAIT
from .progress import TIMEOUT as PROGRESS_TIMEOUT

MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 16 << 30
MAX_KEYS_PER_CALL = 65536
# Host memory a server holds besides its values and the bytes in flight: the freed receive
# buffers glibc keeps (allocator.SERVER_TRIM_THRESHOLD) and the interpreter with its libraries.
KEPT_BYTES = SERVER_TRIM_THRESHOLD + (256 << 20)
# Shares of the usable memory (usable_memory: the host's less KEPT_BYTES), or of the GPU's that
# the values live on: of --max-memory and --max-inflight-bytes when they are not given, so that
# the defaults of the two and the kept buffers add up to less than the machine (or the
# container's limit). While a snapshot is written (--state-dir), the server holds a host copy
# of every value and optimizer state as well: with the values in host memory, the default
# --max-memory is half the share, so that the two fit in it; on a GPU, at most the share of
# the host's usable memory.
MEMORY_SHARE = 0.75
INFLIGHT_SHARE = 0.2
# cgroup (v2, then v1) files that hold a container's memory limit; an unlimited v1 cgroup says ~2**63.
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may carry (None: no limit); max_inflight_bytes is also the budget of all
    calls together (budget.Budget), and progress_timeout the seconds a peer may move none of a
    call's bytes (progress.py)."""

    max_key_bytes: int = MAX_KEY_BYTES
    max_value_bytes: int = MAX_VALUE_BYTES
    max_keys_per_call: int = MAX_KEYS_PER_CALL
    max_inflight_bytes: int = None
    progress_timeout: float = PROGRESS_TIMEOUT


def add_arguments(parser):
    parser.add_argument("--max-key-bytes", type=int, default=MAX_KEY_BYTES, metavar="N",
                        help="longest str key a request may carry, in bytes of UTF-8; a longer one is refused "
                             "with INVALID_ARGUMENT (default %(default)s)")
    parser.add_argument("--max-value-bytes", type=int, default=MAX_VALUE_BYTES, metavar="N",
                        help="bytes of one value (of the slice this server holds); a request that declares a "
                             "larger one is refused with RESOURCE_EXHAUSTED before anything is allocated "
                             "(default %(default)s: 16 GiB)")
    parser.add_argument("--max-keys-per-call", type=int, default=MAX_KEYS_PER_CALL, metavar="N",
                        help="keys one call may carry or name; a call with more is refused with RESOURCE_EXHAUSTED "
                             "(default %(default)s)")
    parser.add_argument("--max-inflight-bytes", type=int, metavar="N",
                        help="the server-wide budget for bytes in flight: values being received (values in "
                             "shared memory are not counted) and answers being built and sent, of all calls "
                             f"together. A call waits for room (at most {BUDGET_WAIT:g} s or its deadline), then is "
                             "refused with RESOURCE_EXHAUSTED; one that needs more than the whole budget is refused "
                             f"at once. Keep --max-memory + this + {size(KEPT_BYTES)} (buffers the server keeps, and "
                             "the interpreter) below the host's memory or the container's limit, as the defaults "
                             "do (default: 20%% of the host's memory, or of the container's limit, less "
                             f"{size(KEPT_BYTES)})")
    parser.add_argument("--progress-timeout", type=float, default=PROGRESS_TIMEOUT, metavar="S",
                        help="seconds a peer may move none of a call's bytes: a call whose request stops coming "
                             "(on the data channel, or a stream of messages) or whose answer the peer stops taking "
                             "ends with DEADLINE_EXCEEDED, its bytes in flight given back, its data channel closed, "
                             "and a WARNING names the peer (default %(default)s)")
    parser.add_argument("--max-memory", type=int, metavar="N",
                        help="bytes this server may hold in stored values and the optimizer states they need "
                             "(counted for every key as soon as an optimizer is installed; values of calls in "
                             "flight are not counted); an init or SetUpdater that would pass it is refused with "
                             "RESOURCE_EXHAUSTED (default: 75%% of the memory of the device the values live on: "
                             f"the GPU's, or the host's (or the container's limit) less {size(KEPT_BYTES)}, which "
                             "with the "
                             "default --max-inflight-bytes leaves room for both; with --state-dir, as a snapshot "
                             "holds a host copy of every value while it is written, 37.5%% of that for values in "
                             "host memory, and at most 75%% of it for values on a GPU)")


# Bytes of an entry besides its key and data, at most: tags, lengths, dtype, shape, slice, refs.
ENTRY_ROOM = 256


def max_call_bytes(limits):
    """The longest request of one call (a gRPC message, a call on a data channel): the values
    --max-inflight-bytes allows, and room for the keys and entries of --max-keys-per-call
    (the decoder then checks each); None without a limit."""
    if limits.max_inflight_bytes is None:
        return None
    return limits.max_inflight_bytes + limits.max_keys_per_call * (limits.max_key_bytes + ENTRY_ROOM)


def check(args, parser):
    """parser.error for a limit in the parsed ``args`` below 1, or a progress timeout not positive."""
    for flag in ("max_key_bytes", "max_value_bytes", "max_keys_per_call", "max_inflight_bytes", "max_memory"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if not args.progress_timeout > 0:
        parser.error("--progress-timeout must be positive")


def from_args(args, xp):
    """(the :class:`Limits` of the parsed ``args``, --max-memory in bytes) for values that live
    in the array namespace ``xp`` (NumPy, or CuPy on the current GPU)."""
    inflight = args.max_inflight_bytes or int(usable_memory() * INFLIGHT_SHARE)
    if args.max_memory:
        memory = args.max_memory
    elif xp.__name__ == "numpy":
        memory = int(usable_memory() * (MEMORY_SHARE / 2 if args.state_dir is not None else MEMORY_SHARE))
    else:  # on the GPU; a snapshot's copy is on the host
        memory = int(xp.cuda.Device().mem_info[1] * MEMORY_SHARE)
        if args.state_dir is not None:
            memory = min(memory, int(usable_memory() * MEMORY_SHARE))
    return Limits(args.max_key_bytes, args.max_value_bytes, args.max_keys_per_call, inflight,
                  args.progress_timeout), memory


def snapshot_room(args, xp, max_memory):
    """A warning, or None: whether what ``max_memory`` lets the server store, with the host
    copy each snapshot (--state-dir) holds while it is written, fits in the host's memory."""
    if args.state_dir is None:
        return None
    on_host = xp.__name__ == "numpy"
    held, memory = (2 * max_memory if on_host else max_memory), host_memory()
    if held <= memory:
        return None
    return (f"--max-memory {size(max_memory)} leaves no room for a snapshot's copy: a full server holds up to "
            f"{size(held)} of host memory while one is written, more than the {size(memory)} this server has; "
            f"give at most {size(memory // 2 if on_host else memory)}")


def usable_memory():
    """The host's memory (host_memory) less what the server keeps besides values and bytes in
    flight (KEPT_BYTES); at least a quarter of it."""
    host = host_memory()
    return max(host - KEPT_BYTES, host // 4)


def host_memory():
    """The bytes of memory of this host, or of the container's cgroup when that is less."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as file:
                limit = file.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


def describe(limits, max_memory):
    """The limits in words, for the log line at start."""
    return (f"limits: {size(limits.max_value_bytes)} per value (--max-value-bytes), "
            f"{plural(limits.max_keys_per_call, 'key')} per call (--max-keys-per-call), "
            f"{size(limits.max_inflight_bytes)} in flight (--max-inflight-bytes), "
            f"{size(max_memory)} stored (--max-memory), "
            f"{limits.progress_timeout:g} s without progress (--progress-timeout)")
