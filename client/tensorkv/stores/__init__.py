"""The stores a user holds: the :class:`KVStore` API (``kvstore``, the arguments of its calls
in ``arguments``), the embedded stores 'local' and 'device' (``local``), the remote ones
'dist_sync' and 'dist_async' (``dist``, which spreads values over the servers by ``spread``
and checks the lists of keys it calls again with ``fusion``), and the :class:`Trainer`
(``trainer``). :func:`tensorkv.create` makes them.
"""
