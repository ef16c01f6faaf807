"""What travels between a worker and a server, the same on both ends: the codec of tensor
streams (``codec``, the interface, with ``entries``, ``protobuf`` and ``decoding``) and its
packed layouts (``packed``); row-sparse values and optimizer states in messages
(``rowsparse_wire``, ``states_wire``) and on disk (``states_file``); errors as gRPC statuses
(``status``); the gRPC options (``grpc_options``); the data channel's framing (``datachan``),
shared memory's layout (``shm``) and server addresses (``addresses``); and the buffers
streams are received into (``allocator``). The server (``tensorkv_server``) imports these,
never :mod:`tensorkv.transport`.
"""
