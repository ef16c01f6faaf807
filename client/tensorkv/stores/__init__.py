"""The stores a user holds: the :class:`KVStore` API (``kvstore``), the embedded stores
'local' and 'device' (``local``), the remote ones 'dist_sync' and 'dist_async' (``dist``,
with tensor fusion's lists in ``fusion``), and the :class:`Trainer` (``trainer``).
:func:`tensorkv.create` makes them.
"""
