"""The instance: what ``app.py`` runs, one per slot, inside the user's CosyVoice environment.

Imports only itself and :mod:`cosyvoice_lb.common`, never the launcher: staging copies this
package and ``common`` whole into the state dir, and nothing else is there.
"""
