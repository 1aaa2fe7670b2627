"""The HTTP API's pieces: forms in, the OpenAI-compatible routes, streamed answers."""
