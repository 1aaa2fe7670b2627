"""How many instances fit and where: the inventory (NVML), the footprint, the plan, preflight."""
