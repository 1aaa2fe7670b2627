"""The running cluster, orchestrated: the lifecycle (up, restart, drain, down), writing the
rendered files (``disk``), calibration, nginx reloads, status, backups, the MPS daemon."""
