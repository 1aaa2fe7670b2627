"""cosyvoice-lb: one GPU box as a load-balanced CosyVoice3 text-to-speech service.

Kept free of imports on purpose: the instance side (``server``, ``engines``) runs in the
model's Python environment, which has none of the launcher's dependencies.
"""

__version__ = "0.2.0"
