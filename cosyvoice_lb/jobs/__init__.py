"""Long-form speech jobs: a text too long for one request becomes a background job.

- :mod:`cosyvoice_lb.jobs.model`: the job record, its status transitions, the public JSON
  shape and pagination; pure (no I/O, no clock: callers pass ``now``).
- :mod:`cosyvoice_lb.jobs.store`: where jobs live, one interface and two adapters: SQLite in
  the state dir (one box) or Redis (pods that share one store).
"""
