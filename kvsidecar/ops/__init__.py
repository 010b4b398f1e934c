"""Operational signals the server derives from the engine's stats snapshot: whether P/D
transfers happen at all (``flow``), the Prometheus families of the cost matrix and of that
signal (``collector``), of push mode (``push_metrics``) and of the staging pool
(``staging_metrics``), and the server's periodic tick that drives them (``tick``: loop lag,
watchdog, the window, republishing the discovery record with its costs).

May import: the engine's face and leaves (``engine.core``, ``engine.stats``, ``ratelog``),
``discovery``, ``health``, ``types``, ``prometheus_client``; never the rpc, the server or the
settings (the server passes itself and its settings in, typed as protocols).

The families of UCX's transport choices (``ucx_metrics``) read the transfer backend's
``transports()`` instead, which the server hands them.
"""
