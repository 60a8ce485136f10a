"""Estimates for audio and file parts, whose billing OpenAI does not document exactly.

Audio: about 10 tokens per second of input audio (OpenAI's realtime docs: one token per 100 ms
of user audio). The duration comes from a WAV header, else (no header, a junk one, data that
is not base64) from the size at 128 kbit/s (mp3).
Files (PDF): OpenAI feeds the model each page's extracted text plus an image of the page. We
count pages (`/Type /Page` objects, else one per 50 kB) and charge each page one image of
unknown size (`remote_image_tokens`) plus 500 tokens of text, a dense page. A `file_id` alone
counts as one page. Other inline files count as text at 4 bytes per token.
"""

from __future__ import annotations

import math
import re
import struct

from proxy.tokens.dataurl import DataURL

AUDIO_TOKENS_PER_SECOND = 10
MP3_BYTES_PER_SECOND = 128_000 // 8
PAGE_TEXT_TOKENS = 500
BYTES_PER_PAGE = 50_000
BYTES_PER_TOKEN = 4
_PDF_PAGE = re.compile(rb"/Type\s*/Page(?![a-zA-Z])")
_WAV_MAX_CHUNKS = 64
# Below telephone quality (8 kHz, 8 bit, mono: 8,000 B/s) a WAV header is junk, and would
# turn a few bytes into hours of audio: the size estimate applies instead.
_WAV_MIN_BYTE_RATE = 4_000


def audio_tokens(data: object, fmt: object) -> int:
    if not isinstance(data, str) or not data:
        return 0
    url = DataURL.parse(data) or DataURL("", data)  # input_audio.data is bare base64
    seconds = _wav_seconds(url) if fmt == "wav" or url.read(0, 4) == b"RIFF" else None
    if seconds is None:
        seconds = url.size / MP3_BYTES_PER_SECOND
    return math.ceil(seconds * AUDIO_TOKENS_PER_SECOND)


def _wav_seconds(url: DataURL) -> float | None:
    head = url.read(0, 12)
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    offset, byte_rate = 12, 0
    for _ in range(_WAV_MAX_CHUNKS):
        chunk = url.read(offset, 20)  # chunk id, size, and the fmt fields up to the byte rate
        if len(chunk) < 8:
            return None
        kind = chunk[:4]
        (size,) = struct.unpack("<I", chunk[4:8])
        if kind == b"fmt " and len(chunk) >= 20:
            (byte_rate,) = struct.unpack("<I", chunk[16:20])
        elif kind == b"data":
            if byte_rate < _WAV_MIN_BYTE_RATE:
                return None
            size = min(size, max(0, url.size - offset - 8))  # streamed WAVs say 0xFFFFFFFF
            return float(size) / byte_rate
        offset += 8 + size + (size & 1)
    return None


def file_tokens(file: object, page_tokens: int) -> int:
    """`page_tokens` is the model's price of one page image (`remote_image_tokens`, scaled)."""
    if not isinstance(file, dict):
        return 0
    data = file.get("file_data")
    url = DataURL.parse(data) if isinstance(data, str) else None
    if url is None:
        return page_tokens + PAGE_TEXT_TOKENS if file.get("file_id") or data else 0
    if url.mime not in ("application/pdf", ""):
        return math.ceil(url.size / BYTES_PER_TOKEN)
    raw = url.read_all()
    pages = len(_PDF_PAGE.findall(raw)) or max(1, len(raw) // BYTES_PER_PAGE)
    return pages * (page_tokens + PAGE_TEXT_TOKENS)
