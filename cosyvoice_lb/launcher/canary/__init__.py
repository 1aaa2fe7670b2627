"""Model roll-outs that compare before they promote (``cosyvoice-lb canary``): the canary's
state file (``state``), the comparison of both sides (``compare``, pure) and the steps that
start, promote and abort one (``rollout``)."""
