"""The CLI's command groups besides ``cli.py``'s own (``backup``/``restore``, ``canary``,
``k8s``, ``prepare-model``, ``service``): the top floor, with ``cli.py``, ``options.py``
and ``views.py``."""
