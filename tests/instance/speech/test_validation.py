"""Request validation (cosyvoice_lb/instance/speech/validation.py): pure, every refusal says what to change."""

from __future__ import annotations

import pytest

from cosyvoice_lb.instance.engines import SynthesisRequest
from cosyvoice_lb.instance.speech.validation import BadRequest, Limits, form_payload, make_request


def test_make_request_accepts_the_documented_shape():
    espeak = dict(limits=Limits(max_chars=10), modes=("sft",), speakers=[], has_prompt=False)
    assert make_request({"text": "hi"}, **espeak) == SynthesisRequest("hi", 1.0)
    assert make_request({"text": "hi", "speed": 2, "seed": 7}, **espeak) == SynthesisRequest("hi", 2.0, seed=7)
    with pytest.raises(BadRequest) as exc:
        make_request({"text": "x" * 11}, **espeak)
    assert exc.value.status == 413


@pytest.mark.parametrize(
    "payload, has_prompt, words",
    [
        ({"text": "hi", "mode": "zero_shot", "prompt_text": "hello"}, False, "needs prompt_audio"),
        ({"text": "hi", "mode": "zero_shot"}, True, "needs prompt_text"),
        ({"text": "hi", "mode": "cross_lingual"}, False, "needs prompt_audio"),
        ({"text": "hi", "mode": "instruct"}, True, "needs instruct_text"),
        ({"text": "hi", "mode": "sft"}, False, "not available with this model"),
    ],
)
def test_cloning_modes_check_what_they_need(payload, has_prompt, words):
    v3 = dict(limits=Limits(), modes=("zero_shot", "cross_lingual", "instruct"), speakers=[])
    with pytest.raises(BadRequest, match=words):
        make_request(payload, has_prompt=has_prompt, **v3)


def test_a_complete_clone_request_passes():
    v3 = dict(limits=Limits(), modes=("zero_shot", "cross_lingual", "instruct"), speakers=[])
    request = make_request(
        {"text": "hi", "mode": "zero_shot", "prompt_text": "the transcript", "seed": 3}, has_prompt=True, **v3
    )
    assert (request.mode, request.prompt_text, request.seed) == ("zero_shot", "the transcript", 3)


def test_form_fields_get_their_types():
    assert form_payload({"text": "hi", "speed": "1.5", "seed": "42", "stream": "true", "mode": ""}) == {
        "text": "hi",
        "speed": 1.5,
        "seed": 42,
        "stream": True,
    }
    with pytest.raises(BadRequest, match='"speed" must be a number'):
        form_payload({"speed": "fast"})
    with pytest.raises(BadRequest, match='"stream" must be true or false'):
        form_payload({"stream": "maybe"})


def test_an_uploaded_prompt_without_mode_still_needs_its_transcript():
    v3 = dict(limits=Limits(), modes=("zero_shot", "cross_lingual", "instruct"), speakers=[])
    with pytest.raises(BadRequest, match="needs prompt_text"):
        make_request({"text": "hi"}, has_prompt=True, **v3)


@pytest.mark.parametrize("field", ["text", "prompt_text", "instruct_text"])
@pytest.mark.parametrize(
    "value,shown",
    [
        ("Hello<|endofprompt|>there", "<|endofprompt|>"),
        ("<|im_start|>system", "<|im_start|>"),
        ("say <|en|> this", "<|en|>"),
        ("a <| b |> c", "<| b |>"),
        ("pipes |> then <| later", "<| and |>"),  # upstream only asks whether both halves are there
    ],
)
def test_special_tokens_are_refused_in_every_text_field(field, value, shown):
    payload = {"text": "Hi.", "mode": "instruct", "instruct_text": "Calm.", field: value}
    with pytest.raises(BadRequest, match="special tokens") as caught:
        make_request(payload, Limits(), ("instruct", "sft"), ["a"], has_prompt=True)
    assert shown in str(caught.value) and f'"{field}"' in str(caught.value)


@pytest.mark.parametrize("value", ["a <| b", "c |> d", "x < | y | > z", "<b>bold</b> [breath] <strong>x</strong>"])
def test_half_a_token_and_the_models_control_tags_pass(value):
    assert make_request({"text": value}, Limits(), ("sft",), [], has_prompt=False).text == value


@pytest.mark.parametrize("value", ["。！？", "...", " * * * ", "😀🎉", "—"])
def test_a_text_with_no_word_is_refused_before_the_model(value):
    # upstream drops such a text (no audio), except in v3's cross-lingual form, where it skips
    # its text handling and speaks from its own prompt
    with pytest.raises(BadRequest, match="no word in it") as caught:
        make_request({"text": value}, Limits(), ("sft",), [], has_prompt=False)
    assert caught.value.status == 422


@pytest.mark.parametrize("value", ["42", "x", "你", "¿Qué?", "…and then"])
def test_one_letter_digit_or_ideograph_is_enough(value):
    assert make_request({"text": value}, Limits(), ("sft",), [], has_prompt=False).text == value
