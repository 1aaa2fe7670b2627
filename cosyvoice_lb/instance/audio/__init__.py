"""Audio in and out: prompt uploads and WAV, the response formats, long texts' segments."""
