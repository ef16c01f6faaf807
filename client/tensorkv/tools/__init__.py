"""The commands: ``tensorkv`` (``ctl``, the operator's CLI) and ``tensorkv-launch``
(``launch``, a job's servers and workers started together)."""
