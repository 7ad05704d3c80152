"""Connection hand-off of ``pdlb serve --processes N`` (:mod:`balancer.service.handoff`): the
parent's acceptor passes accepted sockets to the processes' channels in turn, each one served
where it lands. Here two "processes" are two protocol factories in one loop, so the expected
spread is exact: connections 0, 2, 4, ... on the first, 1, 3, 5, ... on the second."""

import asyncio
import socket

from balancer.service.handoff import Acceptor, adopt_connections, channel_pair


class _Tag(asyncio.Protocol):
    """Answers each received chunk with ``<tag>:<chunk>``."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def connection_made(self, transport) -> None:  # noqa: ANN001
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(self.tag.encode() + b":" + data)


async def test_connections_go_to_the_processes_in_turn_and_a_gone_one_is_skipped():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    pairs = [channel_pair() for _ in range(2)]
    stops = [adopt_connections(child, lambda tag=f"p{k}": _Tag(tag)) for k, (_, child) in enumerate(pairs)]
    acceptor = Acceptor(listener, [ours for ours, _ in pairs])
    try:
        async def ask(msg: bytes) -> bytes:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(msg)
            out = await r.read(100)
            w.close()
            return out

        got = [await ask(f"m{i}".encode()) for i in range(6)]
        assert got == [b"p0:m0", b"p1:m1", b"p0:m2", b"p1:m3", b"p0:m4", b"p1:m5"]
        assert acceptor.handed == [3, 3]
        # process 1 goes away (its end closed): its turns fall to process 0, nothing is lost
        stops[1]()
        await asyncio.sleep(0.05)
        got = [await ask(f"n{i}".encode()) for i in range(4)]
        assert got == [b"p0:n0", b"p0:n1", b"p0:n2", b"p0:n3"]
        assert acceptor.handed == [7, 3]
    finally:
        for stop in stops:
            stop()
        acceptor.close()
    # closed: the port no longer takes connections
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0
