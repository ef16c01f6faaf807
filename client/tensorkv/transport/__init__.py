"""The worker's side of the connection to its servers: one :class:`ServerConn` per server
(``server_conn``) with its Session stream (``session``), the ways a call's values travel on
it (``routes``: in the messages, shared memory, the data channel, packed; ``gpu_routes``:
pinned shared memory, CUDA IPC), the worker's halves of shared memory and the data channel
(``shm``, ``datachan``), the pushes kept to send again after a restart (``replay``), the stub
(``rpc``), the channels' credentials (``security``) and the leases of the worker's ranks
(``lease``). Only the worker imports it.
"""
