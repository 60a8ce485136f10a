"""Random access into a base64 data URL without decoding all of it.

Images and audio arrive as multi-megabyte base64 strings; to price them we need a few header
bytes (and sometimes a JPEG marker deep inside). Base64 maps every 3 bytes to 4 characters, so
bytes [i, i+n) can be decoded from a small slice of the string.
"""

from __future__ import annotations

import binascii
import re

_WHITESPACE = re.compile(r"\s+")


class DataURL:
    """`data:[<mime>][;params];base64,<payload>`; `read()` returns b"" past the end or on junk."""

    __slots__ = ("_payload", "_repaired", "mime")

    def __init__(self, mime: str, payload: str) -> None:
        self.mime = mime
        self._payload = payload
        self._repaired = False

    @classmethod
    def parse(cls, url: str) -> DataURL | None:
        if not url.startswith("data:"):
            return None
        comma = url.find(",", 0, 512)
        if comma < 0:
            return None
        meta = url[5:comma].split(";")
        if "base64" not in (part.strip().lower() for part in meta[1:]):
            return None
        return cls(meta[0].strip().lower(), url[comma + 1 :])

    @property
    def size(self) -> int:
        """Decoded length, from the payload length alone."""
        payload = self._payload.rstrip("=")
        return len(payload) * 3 // 4

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or length <= 0:
            return b""
        start = offset // 3 * 4
        end = (offset + length + 2) // 3 * 4
        chunk = self._payload[start:end].rstrip("=")
        if len(chunk) % 4 == 1:
            chunk = chunk[:-1]
        chunk += "=" * (-len(chunk) % 4)
        try:
            raw = binascii.a2b_base64(chunk, strict_mode=True)
        except ValueError:  # binascii.Error, or non-ASCII characters in the payload
            if self._repaired:
                return b""
            self._repair()
            return self.read(offset, length)
        skip = offset - offset // 3 * 3
        return raw[skip : skip + length]

    def read_all(self) -> bytes:
        try:
            return binascii.a2b_base64(self._payload)
        except ValueError:
            return b""

    def _repair(self) -> None:
        """Line breaks and the URL-safe alphabet shift offsets; normalize once, only if needed."""
        self._repaired = True
        cleaned = _WHITESPACE.sub("", self._payload).replace("-", "+").replace("_", "/")
        self._payload = cleaned
