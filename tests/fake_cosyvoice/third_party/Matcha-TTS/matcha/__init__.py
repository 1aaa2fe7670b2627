"""Stand-in for upstream's Matcha-TTS submodule: importable only from third_party/Matcha-TTS."""
