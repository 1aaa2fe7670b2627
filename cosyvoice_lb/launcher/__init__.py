"""The launcher: the ``cosyvoice-lb`` CLI and the processes it puts under supervisord.

Runs in the launcher's venv (click, jinja2, supervisor, rich, yaml). It may import the
instance package for its pure parts; the instance never imports it.
"""
