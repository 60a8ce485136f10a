"""bench/load.py's client reports: one short result line per run, whatever its length (the
driver reads it from the client's stdout), and a huge request the proxy cuts off is a row of
the table, not a crash."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest

from bench import load


def test_a_long_run_reports_its_statistics_in_a_short_line() -> None:
    gaps = [0.010 + (i % 97) / 100_000 for i in range(200_000)]  # a long compacted case
    line = json.dumps({"seconds": 60.0, "gaps": load.summary(gaps), "failures": 0, "huge": {}})
    assert len(line) < 300  # every sample made this ~4 MB
    reported = json.loads(line)["gaps"]
    assert reported["n"] == 200_000
    assert load.ms(reported, "p50") == f"{sorted(gaps)[100_000] * 1000:.1f}"
    assert load.ms(reported, "max") == f"{max(gaps) * 1000:.1f}"
    assert load.ms(load.summary([]), "p99") == "-"


def test_a_request_the_proxy_cuts_off_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def reset_at_once() -> None:
        conn, _ = listener.accept()
        conn.recv(1024)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        conn.close()  # RST: the rest of the body is refused

    thread = threading.Thread(target=reset_at_once)
    thread.start()
    request = tmp_path / "huge"
    request.write_bytes(b"POST / HTTP/1.1\r\n\r\n" + bytes(8 << 20))
    try:
        load.send_main(port, str(request))
    finally:
        thread.join()
        listener.close()
    result = json.loads(capsys.readouterr().out)
    assert result["status"] == -1
    assert result["code"] in ("ConnectionResetError", "BrokenPipeError")
