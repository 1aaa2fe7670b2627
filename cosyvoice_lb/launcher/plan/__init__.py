"""How many instances fit and where: the inventory (NVML), the footprint, the plan, preflight,
CUDA MPS's environment. Reads the state dir (a calibrated footprint); ``cluster/calibration``
is what measures one."""
