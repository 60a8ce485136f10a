"""bench/memory.py's first-request timing starts request 1's clock only once the server holds
the connection: a connection still in the listen backlog is not yet the server's."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from bench import memory

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def test_a_connection_counts_as_accepted_only_once_the_server_accepts_it() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    with listener, socket.create_connection(listener.getsockname()) as client:
        client_port = client.getsockname()[1]
        assert not memory._server_has_accepted(os.getpid(), client_port)  # in the backlog
        accepted, _ = listener.accept()
        with accepted:
            assert memory._server_has_accepted(os.getpid(), client_port)
        assert not memory._server_has_accepted(os.getpid(), client_port)  # closed again
