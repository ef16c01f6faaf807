"""The update layer, run by the embedded stores and by the servers alike: the stored values
and how pushes merge into them (``engine``), the fused element-wise kernels (``kernels``),
row-sparse values (``rowsparse``) and 2-bit gradient compression (``compression``). The
optimizers and schedules it applies keep their public names: :mod:`tensorkv.optimizer` and
:mod:`tensorkv.lr_scheduler`.
"""
