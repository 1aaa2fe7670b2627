"""The control panel and the cluster's /metrics (one process, behind nginx)."""
