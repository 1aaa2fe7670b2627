#!/usr/bin/env python3
"""Entry point of one cosyvoice-lb instance: the Gradio UI, the HTTP API and /ping.

supervisord runs ``python app.py --port 7860 --engine espeak ...`` once per slot; see
``python app.py --help``. Everything lives in ``cosyvoice_lb.instance.server``.
"""

import os
import sys

if __name__ == "__mp_main__":  # a process the instance spawned (vLLM's engine): it ends with the instance
    from cosyvoice_lb.instance.lineage import follow_parent

    follow_parent()

if __name__ == "__main__":
    # Run from a checkout, the package sits beside this file.
    # (realpath: a staged tree is reached through a symlink that a roll-out swaps; keep this one)
    here = os.path.dirname(os.path.realpath(__file__))
    if os.path.isdir(os.path.join(here, "cosyvoice_lb")):
        sys.path.insert(0, here)
    from cosyvoice_lb.instance.server import main

    main()
