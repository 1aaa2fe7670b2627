"""Upstream's vLLM model class for the CosyVoice2/3 LLM (here only its name matters)."""


class CosyVoice2ForCausalLM:
    pass
