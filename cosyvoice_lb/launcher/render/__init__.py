"""The cluster's files rendered from the plan (pure), and the credentials and staged code
they name; ``cluster/disk.py`` writes them and checks them on disk."""
