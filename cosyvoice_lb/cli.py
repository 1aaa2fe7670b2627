"""Shim: the console script and ``python -m cosyvoice_lb.cli`` of 0.1 (see launcher.compat)."""

from cosyvoice_lb.launcher.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
