"""Shim: ``python -m cosyvoice_lb.mps``, as clusters of 0.1 run it (see launcher.compat)."""

from cosyvoice_lb.launcher.compat import run_moved

if __name__ == "__main__":
    run_moved(__spec__.name if __spec__ else "cosyvoice_lb.mps")
