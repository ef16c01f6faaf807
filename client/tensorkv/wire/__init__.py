"""What travels between a worker and a server, the same on both ends: the codec of tensor
streams and its packed layouts, row-sparse values and optimizer states on the wire and on
disk, errors as gRPC statuses, the gRPC options, and the buffers streams are received into.
The server (``tensorkv_server``) imports these, never :mod:`tensorkv.transport`.
"""
