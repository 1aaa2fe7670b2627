"""Sizes (cosyvoice_lb/common/sizes.py): read as every flag takes them, written back the same way."""

from __future__ import annotations

import pytest

from cosyvoice_lb.common.sizes import GiB, MiB, SizeError, format_size, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("24GiB", 24 * GiB),
        ("24G", 24 * GiB),
        ("24GB", 24 * GiB),  # binary, on purpose: a card's "24GB" label is 24 GiB
        ("24Gi", 24 * GiB),
        ("24576MiB", 24 * GiB),
        ("512M", 512 * MiB),
        ("512MB", 512 * MiB),
        ("1.5GiB", 3 * GiB // 2),
        ("0.5G", 512 * MiB),
        ("4KiB", 4096),
        ("2T", 2 * 1024**4),
        ("1TiB", 1024**4),
        ("1024", 1024),  # a plain number is bytes
        ("1024B", 1024),
        ("0", 0),
        ("24gib", 24 * GiB),
        ("24g", 24 * GiB),
        ("24gb", 24 * GiB),
        ("512mib", 512 * MiB),
        (" 24 GiB ", 24 * GiB),
        (2048, 2048),  # not a string: read through str()
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "GiB",
        "abc",
        "-1GiB",
        "+5G",
        "24XB",
        "24PB",
        "1e9",
        "1,5GiB",
        "24 GiB extra",
        "24GiBs",
        "5 GiB/s",
        "0x10",
        "1.GiB",
        ".5G",
        "five",
        "24i",
        "5 iB",
        "24iB",
    ],
)
def test_parse_size_rejects_with_a_helpful_message(text):
    with pytest.raises(SizeError) as caught:
        parse_size(text)
    message = str(caught.value)
    assert repr(text) in message  # says what it could not read
    assert "24GiB" in message and "24576MiB" in message  # and shows what it can read


def test_size_error_is_a_value_error():
    assert issubclass(SizeError, ValueError)


@pytest.mark.parametrize(
    "size, text",
    [
        (5 * GiB, "5.0 GiB"),
        (GiB, "1.0 GiB"),
        (3 * GiB // 2, "1.5 GiB"),
        (24 * GiB, "24.0 GiB"),
        (GiB - MiB, "1023 MiB"),
        (512 * MiB, "512 MiB"),
        (MiB, "1 MiB"),
        (0, "0 MiB"),
    ],
)
def test_format_size(size, text):
    assert format_size(size) == text


@pytest.mark.parametrize("text", ["5GiB", "512MiB", "1.5GiB", "24GiB"])
def test_format_size_reads_back_with_parse_size(text):
    assert parse_size(format_size(parse_size(text)).replace(" ", "")) == parse_size(text)
