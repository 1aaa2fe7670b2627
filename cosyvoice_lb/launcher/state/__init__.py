"""The state dir, the launcher's lowest floor: every file a cluster keeps there (its layout,
``cluster.json``, the markers, the health report, the canary's file), its supervisord and its
processes, each with its reader and writer. Imports nothing of the launcher above it."""
