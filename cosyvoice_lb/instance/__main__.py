"""One instance: ``python -m cosyvoice_lb.instance --port 7860 --engine espeak ...``.

Staging also writes this file as ``app.py`` at the root of the staged tree, which
supervisord runs as a script: the package it imports is the one beside it, at the tree's
real path, so a roll-out that swaps the ``run/lib`` link changes no running instance's code.
"""

import os
import sys

if __name__ == "__mp_main__":  # a process the instance spawned (vLLM's engine): it ends with the instance
    from cosyvoice_lb.instance.lineage import follow_parent

    follow_parent()

if __name__ == "__main__":
    if not __package__:  # (run as a file: the staged app.py)
        sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
    from cosyvoice_lb.instance.server import main

    main()
