"""The GPU bench's servers and stores (bench/gpu.py, bench/resnet_step.py): a server on a
device on 127.0.0.1, a one-worker store that takes a given route to it, and the route it took."""
import contextlib
import os

from run import server

CALL_TIMEOUT = 60.0  # seconds any one tensorkv call gets
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def server_device(address):
    """The device a server says its values live on (its Info)."""
    import grpc
    from tensorkv.v1 import kvstore_pb2, kvstore_pb2_grpc
    with grpc.insecure_channel(address) as channel:
        return kvstore_pb2_grpc.KVStoreServiceStub(channel).Info(kvstore_pb2.InfoRequest(), timeout=10).device


@contextlib.contextmanager
def started_server(device, logdir):
    """A one-worker sync server on 127.0.0.1 with ``--device device``; yields its address and
    checks that it put its values where asked."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(ROOT, "client"), os.path.join(ROOT, "server")]
        + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    with server(1, env, logdir, ("--device", device, "--log-level", "WARNING")) as address:
        actual = server_device(address)
        if actual.split(":")[0] != device.split(":")[0]:
            raise RuntimeError(f"server {address} started with --device {device} reports device {actual!r}")
        yield address


def open_store(address, transport="auto"):
    """A dist_sync store of the one worker of ``address``, dropping an earlier row's keys;
    ``transport`` 'pinned' is 'auto' with CUDA IPC off in its session (GPU values then take
    the region pinned on both ends)."""
    import tensorkv
    kv = tensorkv.create("dist_sync", servers=address, transport="auto" if transport == "pinned" else transport,
                         if_exists="replace", timeout=CALL_TIMEOUT)
    if transport == "pinned":
        kv._conns[0].session.ipc_refused = True
    return kv


def route(kv):
    """How this store's large values went, read after its calls: 'CUDA IPC' (buffers opened
    on the server), 'pinned shared memory' or 'shared memory' (a region was set up), else
    'tcp' (the data channel) or 'grpc'."""
    session = getattr(kv._conns[0], "session", None)
    if getattr(session, "cuda_buffers", None):
        return "CUDA IPC"
    region = getattr(session, "region", None)
    if region is not None:
        return "pinned shared memory" if region.pinned else "shared memory"
    return "grpc" if kv.transport == "grpc" else "tcp"
