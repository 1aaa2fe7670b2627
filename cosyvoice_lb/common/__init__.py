"""What both runtimes share: settings, timeouts, sizes, atomic files, pid checks, the error body.

Standard library only: the instance imports it inside the user's CosyVoice environment, the
launcher inside its own venv (tests/test_layering.py holds both to that).
"""
