"""The cluster's files: rendered from the plan (pure), then written and checked on disk."""
