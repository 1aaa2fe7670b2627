"""From a checked request to kept audio: validation, admission, the pipeline, poison requests."""
