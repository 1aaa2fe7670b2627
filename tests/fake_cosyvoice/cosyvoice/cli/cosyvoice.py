"""Contract fake of upstream cosyvoice/cli/cosyvoice.py: same classes, signatures and
assertions; synthetic audio instead of a model."""

import math
import os
import re
import sys
import time

import matcha  # noqa: F401  upstream's imports need third_party/Matcha-TTS on sys.path
import soundfile
import torch

ENDOFPROMPT = "<|endofprompt|>"


def snapshot_download(model_id):
    # Upstream downloads from ModelScope here; nothing may be downloaded in these tests.
    raise RuntimeError(f"fake CosyVoice: would download {model_id!r} from ModelScope")


class _Frontend:
    """upstream CosyVoiceFrontEnd: holds spk2info (built-in speakers and cached prompts)."""

    def __init__(self, speakers):
        self.spk2info = {spk: {"embedding": None} for spk in speakers}
        self.extractions = 0  # prompt feature extractions (what a cached speaker skips)


class _Model:
    """upstream CosyVoice2Model/CosyVoice3Model: the streaming chunk size in tokens. Upstream's
    tts() doubles it after every streamed chunk, up to 4x, on the model itself: it stays there
    for every later stream."""

    def __init__(self):
        self.token_hop_len = 25
        self.token_max_hop_len = 4 * self.token_hop_len
        self.first_hops = []  # the chunk size each stream started with (what a test reads)


def _broken():
    """Whether a test made this process's model yield NaN: FAKE_COSYVOICE_NAN_DIR holds a file
    named for the instance's port (its ``--port``)."""
    folder = os.environ.get("FAKE_COSYVOICE_NAN_DIR", "")
    argv = sys.argv
    port = argv[argv.index("--port") + 1] if "--port" in argv[:-1] else ""
    return bool(folder and port and os.path.exists(os.path.join(folder, port)))


def _load_prompt(prompt_wav, frontend=None):
    # upstream's frontend extracts speech tokens, features and an embedding from the prompt:
    # a large part of first-chunk time (modelled when a test asks for it)
    time.sleep(float(os.environ.get("FAKE_COSYVOICE_PROMPT_SECONDS", "0")))
    if frontend is not None:
        frontend.extractions += 1
    speech, rate = soundfile.read(prompt_wav, dtype="float32", always_2d=True)
    # upstream load_wav: sources below 16 kHz fail; its message names the rate it resamples
    # to, and the first load of a prompt is for the 24 kHz features
    assert rate >= 16000, "wav sample rate {} must be greater than {}".format(rate, 24000)
    seconds = speech.shape[0] / rate
    assert seconds <= 30, "do not support extract speech token for audio longer than 30s"
    return seconds


class CosyVoice:
    version = 1

    def __init__(self, model_dir, load_jit=False, load_trt=False, fp16=False, trt_concurrent=1):
        self.model_dir = model_dir
        self.fp16 = fp16
        if not os.path.exists(model_dir):
            model_dir = snapshot_download(model_dir)
        yaml = os.path.join(model_dir, self._yaml)
        if not os.path.exists(yaml):
            raise ValueError("{} not found!".format(yaml))
        self.options = dict(load_jit=load_jit, load_trt=load_trt, fp16=fp16, trt_concurrent=trt_concurrent)
        spk_file = os.path.join(model_dir, "spk2info.txt")  # upstream: spk2info.pt (torch.load)
        self.frontend = _Frontend(open(spk_file).read().split() if os.path.exists(spk_file) else [])
        self.model = _Model() if self.version >= 2 else None  # v1's model has no streaming chunk size
        time.sleep(float(os.environ.get("FAKE_COSYVOICE_LOAD_SECONDS", "1")))  # loading weights
        self.sample_rate = 22050 if self.version == 1 else 24000

    _yaml = "cosyvoice.yaml"

    def list_available_spks(self):
        return list(self.frontend.spk2info.keys())

    def add_zero_shot_spk(self, prompt_text, prompt_wav, zero_shot_spk_id):
        assert zero_shot_spk_id != "", "do not use empty zero_shot_spk_id"
        _load_prompt(prompt_wav, self.frontend)
        # upstream keeps the prompt's text tokens with its features: later calls reuse them
        self.frontend.spk2info[zero_shot_spk_id] = {"prompt_text": prompt_text, "embedding": None}
        return True

    def _prompt(self, prompt_text, prompt_wav, zero_shot_spk_id):
        """upstream frontend_zero_shot: the cached speaker's prompt, or one extracted now."""
        if zero_shot_spk_id == "":
            _load_prompt(prompt_wav, self.frontend)
            return prompt_text
        return self.frontend.spk2info[zero_shot_spk_id]["prompt_text"]  # KeyError, as upstream

    def _speech(self, text, stream, speed):
        spoken = text.split(ENDOFPROMPT)[-1]
        # upstream's text frontend drops a text of punctuation only (nothing to say), but skips
        # itself for a text that holds a special token (v3's cross-lingual form): that one speaks
        if "<|" not in text and not re.search(r"\w", spoken):
            return
        if stream:  # upstream's streaming passes no speed to the vocoder: ignored, not refused
            speed = 1.0
        seconds = max(0.2, 0.06 * len(spoken.strip())) / speed
        n = int(seconds * self.sample_rate)
        t = torch.arange(n, dtype=torch.float32) / self.sample_rate
        pitch = 120.0 + 80.0 * torch.rand(1)
        wave = 0.3 * torch.sin(2 * math.pi * pitch * t) * (0.6 + 0.4 * torch.sin(2 * math.pi * 3 * t))
        wave = (wave + 0.01 * torch.randn(n)).clamp(-0.99, 0.99).unsqueeze(0)  # [1, N]
        if _broken():  # (a test's fault: the model gone bad, as TensorRT fp16 on some cards)
            wave = torch.full_like(wave, float("nan"))
        parts = torch.chunk(wave, 4, dim=1) if stream else (wave,)
        hops = stream and self.model is not None
        if hops:
            self.model.first_hops.append(self.model.token_hop_len)
        for i, part in enumerate(parts):
            if hops and i < len(parts) - 1:  # upstream doubles it after each chunk but the last
                self.model.token_hop_len = min(self.model.token_max_hop_len, self.model.token_hop_len * 2)
            # model the GPU's time per chunk (first-package latency) when a test asks for it
            time.sleep(float(os.environ.get("FAKE_COSYVOICE_CHUNK_SECONDS", "0")) * (1 if stream else 4))
            yield {"tts_speech": part}

    def inference_sft(self, tts_text, spk_id, stream=False, speed=1.0, text_frontend=True):
        assert spk_id in self.frontend.spk2info, "unknown speaker {}".format(spk_id)
        self._check_prompt(tts_text)
        yield from self._speech(tts_text, stream, speed)

    def inference_zero_shot(self, tts_text, prompt_text, prompt_wav, zero_shot_spk_id="", stream=False, speed=1.0,
                            text_frontend=True):
        prompt_text = self._prompt(prompt_text, prompt_wav, zero_shot_spk_id)
        self._check_prompt(prompt_text + tts_text)
        yield from self._speech(tts_text, stream, speed)

    def inference_cross_lingual(self, tts_text, prompt_wav, zero_shot_spk_id="", stream=False, speed=1.0,
                                text_frontend=True):
        self._prompt("", prompt_wav, zero_shot_spk_id)
        self._check_prompt(tts_text)  # upstream drops the prompt text in cross-lingual mode
        yield from self._speech(tts_text, stream, speed)

    def inference_instruct(self, tts_text, spk_id, instruct_text, stream=False, speed=1.0, text_frontend=True):
        assert self.__class__.__name__ == "CosyVoice", "inference_instruct is only implemented for CosyVoice!"
        yield from self._speech(tts_text, stream, speed)

    def _check_prompt(self, text):
        pass


class CosyVoice2(CosyVoice):
    version = 2
    _yaml = "cosyvoice2.yaml"

    def __init__(self, model_dir, load_jit=False, load_trt=False, load_vllm=False, fp16=False, trt_concurrent=1):
        super().__init__(model_dir, load_jit=load_jit, load_trt=load_trt, fp16=fp16, trt_concurrent=trt_concurrent)
        self.options["load_vllm"] = load_vllm
        _check_vllm(load_vllm, "CosyVoice2ForCausalLM")

    def inference_instruct2(self, tts_text, instruct_text, prompt_wav, zero_shot_spk_id="", stream=False, speed=1.0,
                            text_frontend=True):
        # upstream: with a cached speaker its prompt text replaces instruct_text (the
        # instruction is ignored)
        self.last_instruct = instruct_text = self._prompt(instruct_text, prompt_wav, zero_shot_spk_id)
        self._check_prompt(instruct_text + tts_text)
        yield from self._speech(tts_text, stream, speed)


class CosyVoice3(CosyVoice2):
    version = 3
    _yaml = "cosyvoice3.yaml"

    def __init__(self, model_dir, load_trt=False, load_vllm=False, fp16=False, trt_concurrent=1):
        CosyVoice.__init__(self, model_dir, load_jit=False, load_trt=load_trt, fp16=fp16,
                           trt_concurrent=trt_concurrent)
        self.options = dict(load_trt=load_trt, load_vllm=load_vllm, fp16=fp16, trt_concurrent=trt_concurrent)
        _check_vllm(load_vllm, "Qwen2ForCausalLM")

    def _check_prompt(self, text):
        # upstream (cosyvoice/llm/llm.py) checks the token id of <|endofprompt|>
        assert ENDOFPROMPT in text, "<|endofprompt|> not detected in CosyVoice3 text or prompt_text, check your input!"


def _check_vllm(load_vllm, architecture):
    # Upstream exports the LLM for vLLM (export_cosyvoice2_vllm): CosyVoice2's (its decoder
    # has a bias) as CosyVoice2ForCausalLM, which vLLM finds only once it is registered
    # (vllm_example.py does ModelRegistry.register_model before loading); CosyVoice3's as
    # vLLM's own Qwen2ForCausalLM.
    if load_vllm:
        from vllm import ModelRegistry

        assert architecture == "Qwen2ForCausalLM" or architecture in ModelRegistry.get_supported_archs(), \
            f"Model architectures ['{architecture}'] are not supported for now"


def AutoModel(**kwargs):
    if not os.path.exists(kwargs["model_dir"]):
        kwargs["model_dir"] = snapshot_download(kwargs["model_dir"])
    if os.path.exists("{}/cosyvoice.yaml".format(kwargs["model_dir"])):
        return CosyVoice(**kwargs)
    elif os.path.exists("{}/cosyvoice2.yaml".format(kwargs["model_dir"])):
        return CosyVoice2(**kwargs)
    elif os.path.exists("{}/cosyvoice3.yaml".format(kwargs["model_dir"])):
        return CosyVoice3(**kwargs)
    else:
        raise TypeError("No valid model type found!")
