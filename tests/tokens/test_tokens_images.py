"""Image parts: header parsing (PNG, JPEG, GIF, WebP) and the documented tile formula."""

from __future__ import annotations

import base64
import binascii
import struct
import zlib
from collections.abc import Callable

import pytest

from proxy.tokens import TokenCounter
from proxy.tokens.dataurl import DataURL
from proxy.tokens.images import GPT_4O, GPT_4O_MINI, image_size, tiles

CounterFactory = Callable[..., TokenCounter]


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def png(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = (
        struct.pack(">I", len(ihdr))
        + b"IHDR"
        + ihdr
        + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    )
    return b"\x89PNG\r\n\x1a\n" + chunk + b"\x00" * 64


def gif(width: int, height: int) -> bytes:
    return b"GIF89a" + struct.pack("<HH", width, height) + b"\x00" * 32


def jpeg(width: int, height: int, app_bytes: int = 0) -> bytes:
    """SOI, an APP1 (EXIF-like) segment of `app_bytes`, padding fill bytes, then SOF2."""
    out = b"\xff\xd8"
    remaining = app_bytes
    while remaining > 0:  # segments are at most 65533 bytes of payload
        size = min(remaining, 65533)
        out += b"\xff\xe1" + struct.pack(">H", size + 2) + b"\xab" * size
        remaining -= size
    out += b"\xff\xff"  # a fill byte before the marker
    sof = struct.pack(">BHHB", 8, height, width, 3) + b"\x01\x22\x00" * 3
    out += b"\xff\xc2" + struct.pack(">H", len(sof) + 2) + sof
    return out + b"\xff\xda\x00\x02" + b"\x00" * 64 + b"\xff\xd9"


def webp(kind: bytes, width: int, height: int) -> bytes:
    if kind == b"VP8 ":
        data = b"\x00\x00\x00" + b"\x9d\x01\x2a" + struct.pack("<HH", width, height)
    elif kind == b"VP8L":
        bits = (width - 1) | ((height - 1) << 14)
        data = b"\x2f" + struct.pack("<I", bits)
    else:
        data = b"\x00" * 4 + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    chunk = kind + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk + b"\x00" * 16


@pytest.mark.parametrize(
    ("raw", "size"),
    [
        (png(1024, 768), (1024, 768)),
        (gif(320, 200), (320, 200)),
        (jpeg(4032, 3024), (4032, 3024)),
        (jpeg(640, 480, app_bytes=200_000), (640, 480)),
        (webp(b"VP8 ", 1920, 1080), (1920, 1080)),
        (webp(b"VP8L", 300, 7000), (300, 7000)),
        (webp(b"VP8X", 5000, 1), (5000, 1)),
    ],
)
def test_dimensions_come_from_the_header(raw: bytes, size: tuple[int, int]) -> None:
    assert image_size(data_url(raw)) == size


def test_only_the_header_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 200 kB JPEG whose frame header sits behind a big EXIF-like block: a few bytes read."""
    decoded: list[int] = []
    real = binascii.a2b_base64

    def spy(data: str, **kwargs: bool) -> bytes:
        decoded.append(len(data))
        return real(data, **kwargs)

    monkeypatch.setattr(binascii, "a2b_base64", spy)
    url = data_url(jpeg(800, 600, app_bytes=200_000), "image/jpeg")
    # junk after the frame header would break any full decode
    assert image_size(url + "@@@@ not base64 at all @@@@") == (800, 600)
    assert 0 < sum(decoded) < 200


def test_line_broken_and_urlsafe_base64_is_repaired() -> None:
    encoded = base64.urlsafe_b64encode(jpeg(123, 456, app_bytes=5000)).decode()
    wrapped = "\n".join(encoded[i : i + 76] for i in range(0, len(encoded), 76))
    assert image_size(f"data:image/jpeg;base64,{wrapped}") == (123, 456)


@pytest.mark.parametrize(
    "url",
    [
        "https://example.com/cat.png",
        "data:image/png;base64,",
        "data:image/png;base64,!!!!",
        "data:image/svg+xml,<svg></svg>",
        "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n").decode(),
        "data:image/jpeg;base64," + base64.b64encode(b"\xff\xd8\xff\xe1\x00").decode(),
        "data:,",
        "data:" + "x" * 10_000,
    ],
)
def test_unreadable_images_have_no_size(url: str) -> None:
    assert image_size(url) is None


@pytest.mark.parametrize(
    ("width", "height", "tokens"),
    [
        (1024, 1024, 765),  # OpenAI's documented example
        (2048, 4096, 1105),  # OpenAI's documented example
        (500, 500, 255),
        (513, 500, 425),
        (512, 512, 255),
        (4096, 8192, 1105),
        (768, 768, 765),
        (1, 1, 255),
        (10_000, 10, 85 + 170 * 4),
    ],
)
def test_tile_formula(width: int, height: int, tokens: int) -> None:
    assert GPT_4O.for_size(width, height) == tokens


def test_zero_sized_images_cost_the_base() -> None:
    assert tiles(0, 100) == 0
    assert GPT_4O.for_size(0, 0) == 85


def image_message(url: str, detail: str | None = None) -> dict[str, object]:
    image: dict[str, object] = {"url": url}
    if detail is not None:
        image["detail"] = detail
    return {"role": "user", "content": [{"type": "image_url", "image_url": image}]}


def test_image_parts_in_requests(counter: TokenCounter) -> None:
    role = 3 + 1  # framing + "user"
    big = data_url(png(1024, 1024))
    assert counter.count_message("gpt-4o", image_message(big)) == role + 765
    assert counter.count_message("gpt-4o", image_message(big, "high")) == role + 765
    assert counter.count_message("gpt-4o", image_message(big, "low")) == role + 85
    assert counter.count_message("gpt-4o-mini", image_message(big)) == role + 2833 + 4 * 5667
    assert counter.count_message("gpt-4o-mini", image_message(big, "low")) == role + 2833
    remote = "https://example.com/x.png"
    assert counter.count_message("gpt-4o", image_message(remote)) == role + 765
    assert counter.count_message("gpt-4o", image_message(remote, "low")) == role + 85
    assert GPT_4O_MINI.unknown(765) == round(765 * 5667 / 170)  # same tiles, mini's price
    # the bare-string form some clients send
    bare = {"role": "user", "content": [{"type": "image_url", "image_url": big}]}
    assert counter.count_message("gpt-4o", bare) == role + 765


def test_remote_image_tokens_is_configurable(make_counter: CounterFactory) -> None:
    counter = make_counter({"remote_image_tokens": 1000})
    message = image_message("https://example.com/x.png")
    assert counter.count_message("gpt-4o", message) == 4 + 1000


def test_partial_reads_at_the_end_of_the_payload() -> None:
    url = DataURL.parse(data_url(b"abcdefgh"))
    assert url is not None
    assert url.size == 8
    assert url.read(5, 10) == b"fgh"
    assert url.read(8, 4) == b""
    assert url.read(-1, 4) == b""
