"""Model roll-outs that compare before they promote (``cosyvoice-lb canary``): the comparison
of both sides (``compare``, pure) and the steps that start, promote and abort one
(``rollout``). The canary's state file is ``state/canary.py``."""
