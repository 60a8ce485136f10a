"""Image tokens: dimensions from the file header, then OpenAI's documented tile formula.

High/auto detail: fit in 2048x2048, shrink so the short side is at most 768, then
`base + tile * (number of 512-px tiles)`; low detail: `base`. gpt-4o family: 85 + 170/tile;
gpt-4o-mini bills ~33x the tokens (2833 + 5667/tile) for the same price per image.
Only header bytes are decoded (PNG, JPEG, GIF, WebP); anything else, or a remote URL, costs
the configured `remote_image_tokens`, scaled by the model's tile cost.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from proxy.tokens.dataurl import DataURL

TILE_PX = 512
FIT_PX = 2048
SHORT_SIDE_PX = 768
_JPEG_SOF = frozenset(
    {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
)
_JPEG_NO_LENGTH = frozenset({0x01, *range(0xD0, 0xDA)})
_JPEG_MAX_SEGMENTS = 512


@dataclass(frozen=True)
class ImagePricing:
    base: int = 85
    tile: int = 170

    def for_size(self, width: int, height: int) -> int:
        return self.base + self.tile * tiles(width, height)

    def unknown(self, default_tokens: int) -> int:
        """`default_tokens` is in gpt-4o units; other models scale with their tile cost."""
        return round(default_tokens * self.tile / 170)


GPT_4O = ImagePricing(85, 170)
GPT_4O_MINI = ImagePricing(2833, 5667)


def tiles(width: int, height: int) -> int:
    if width <= 0 or height <= 0:
        return 0
    w, h = float(width), float(height)
    if max(w, h) > FIT_PX:
        scale = FIT_PX / max(w, h)
        w, h = math.floor(w * scale), math.floor(h * scale)
    if min(w, h) > SHORT_SIDE_PX:
        scale = SHORT_SIDE_PX / min(w, h)
        w, h = math.floor(w * scale), math.floor(h * scale)
    return max(1, math.ceil(w / TILE_PX)) * max(1, math.ceil(h / TILE_PX))


def image_tokens(url: object, detail: object, pricing: ImagePricing, default_tokens: int) -> int:
    if detail == "low":
        return pricing.base
    size = image_size(url) if isinstance(url, str) else None
    if size is None:
        return pricing.unknown(default_tokens)
    return pricing.for_size(*size)


def image_size(url: str) -> tuple[int, int] | None:
    data = DataURL.parse(url)
    if data is None:
        return None
    head = data.read(0, 32)
    if head.startswith(b"\x89PNG\r\n\x1a\n") and head[12:16] == b"IHDR":
        width, height = struct.unpack(">II", head[16:24])
        return width, height
    if head[:6] in (b"GIF87a", b"GIF89a"):
        width, height = struct.unpack("<HH", head[6:10])
        return width, height
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return _webp_size(head)
    if head[:2] == b"\xff\xd8":
        return _jpeg_size(data)
    return None


def _webp_size(head: bytes) -> tuple[int, int] | None:
    kind = head[12:16]
    if kind == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", head[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if kind == b"VP8L" and head[20:21] == b"\x2f":
        (bits,) = struct.unpack("<I", head[21:25])
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if kind == b"VP8X":
        width = int.from_bytes(head[24:27], "little") + 1
        height = int.from_bytes(head[27:30], "little") + 1
        return width, height
    return None


def _jpeg_size(data: DataURL) -> tuple[int, int] | None:
    """Walk the segment headers to the frame header; EXIF and ICC blocks are skipped unread."""
    offset = 2
    for _ in range(_JPEG_MAX_SEGMENTS):
        head = data.read(offset, 9)
        if len(head) < 2 or head[0] != 0xFF:
            return None
        marker = head[1]
        if marker == 0xFF:  # fill byte
            offset += 1
            continue
        if marker in _JPEG_NO_LENGTH:
            offset += 2
            continue
        if marker in _JPEG_SOF:
            if len(head) < 9:
                return None
            height, width = struct.unpack(">HH", head[5:9])
            return width, height
        if marker in (0xD9, 0xDA):  # end of image / start of scan before any frame header
            return None
        if len(head) < 4:
            return None
        (length,) = struct.unpack(">H", head[2:4])
        if length < 2:
            return None
        offset += 2 + length
    return None
