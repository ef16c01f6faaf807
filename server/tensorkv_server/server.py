"""Wiring of the grpc.aio server: the KVStoreService, health, reflection, and a clean stop
on SIGTERM/SIGINT."""
import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tensorkv.rpc import SERVER_OPTIONS
from tensorkv.v1 import kvstore_pb2

from .datachan import DataPort
from .service import KVStoreService, add_to_server

log = logging.getLogger(__name__)

SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KVStoreService"].full_name


async def serve(coordinator, host, port, grace, shared_memory=True, data_port=0):
    """Serve ``coordinator`` on host:port, and its data channel on host:``data_port`` (0: any
    free port; None: no data channel), until SIGTERM or SIGINT, then stop: waits in progress
    fail with UNAVAILABLE, other calls get ``grace`` seconds to finish."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    data_port = DataPort(host, data_port) if data_port is not None else None
    servicer = KVStoreService(coordinator, shared_memory, data_port)
    add_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{host}:{port}"
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    if data_port is not None:
        data_port.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on %s: %d workers, %s mode, values on %s, round timeout %g s, lease timeout %g s, "
             "shared memory %s, data channel %s", SERVICE_NAME, address, coordinator.num_workers, coordinator.mode,
             coordinator.device, coordinator.round_timeout, coordinator.members.lease_timeout,
             "on" if servicer.shared_memory else "off",
             f"on port {data_port.port}" if data_port else "off")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("stopping: waits in progress fail with UNAVAILABLE, other calls have %g s to finish", grace)
    await health_servicer.enter_graceful_shutdown()
    coordinator.shutdown()
    if data_port is not None:
        data_port.close()  # no new channels; the streams' own close as they end
    await server.stop(grace)
    log.info("stopped")
