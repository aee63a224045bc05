"""The bulk channel's tickets, a pure core with the clock passed in: single use, bound
to a learner, good until they expire; and its frames, through a socket pair."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable

import numpy as np
import pytest

from protos.bulk import (
    HEAD,
    Abort,
    BulkError,
    BulkPool,
    Grant,
    Handoff,
    Tickets,
    checksum,
    receive_frames,
    send_frames,
)
from protos.codec import FP32, INT8
from protos.stream import ChunkReader


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def refusal(tickets: Tickets, ticket: bytes, learner_id: str,
            names: frozenset[str] | None = None) -> str:
    with pytest.raises(BulkError) as refused:
        tickets.redeem(ticket, learner_id, names)
    assert refused.value.reason == "bad_ticket"
    return refused.value.message


def test_a_ticket_is_taken_once_by_its_learner_before_it_expires() -> None:
    async def scenario() -> None:
        clock = Clock()
        tickets = Tickets(30.0, clock)
        handoff = Handoff(Grant("a", 0, 3))
        ticket = tickets.issue(handoff)
        assert refusal(tickets, bytes(16), "a") == "no such ticket"
        assert refusal(tickets, ticket, "b") == "the ticket is learner 'a''s, presented by 'b'"
        assert "issued to b, not to learner 'a'" in refusal(tickets, ticket, "a",
                                                           frozenset({"b"}))
        assert tickets.redeem(ticket, "a", frozenset({"a"})) is handoff
        assert refusal(tickets, ticket, "a").startswith("the ticket is spent")

        late = tickets.issue(Handoff(Grant("a", 1, 3)))
        clock.now += 30.5
        assert refusal(tickets, late, "a") == "the ticket expired (tickets last 30 s)"
        assert refusal(tickets, late, "a").startswith("the ticket is spent")
        clock.now += 60  # forgotten once it would have expired: unknown, not spent
        tickets.issue(Handoff(Grant("a", 2, 3)))
        assert refusal(tickets, late, "a") == "no such ticket"

    asyncio.run(scenario())


def test_a_ticket_for_anyone_and_one_whose_call_ended() -> None:
    async def scenario() -> None:
        tickets = Tickets(30.0, Clock())
        anyone = Handoff(Grant("", 0, 1))  # a peer's reservation
        assert tickets.redeem(tickets.issue(anyone), "", frozenset({"x"})) is anyone
        ended = Handoff(Grant("a", 0, 1))
        ticket = tickets.issue(ended)
        ended.close()
        assert refusal(tickets, ticket, "a") == "the transfer this ticket was for has ended"

    asyncio.run(scenario())


def through_a_socket_pair(send: Callable[[socket.socket], object], reader: ChunkReader,
                          out: np.ndarray, weight: float = 1.0) -> None:
    sender, receiver = socket.socketpair()
    with sender, receiver:
        thread = threading.Thread(target=send, args=(sender,), daemon=True)
        thread.start()
        receive_frames(receiver, reader, out, weight)
        thread.join(10)


def test_frames_arrive_in_place_weighted_and_decoded() -> None:
    values = np.random.default_rng(0).standard_normal(600_000).astype(np.float32)
    out = np.empty_like(values)
    reader = ChunkReader(values.size, "fragment 0")
    through_a_socket_pair(lambda conn: send_frames(conn, values), reader, out, 0.5)
    np.testing.assert_array_equal(out, values * np.float32(0.5))
    assert (reader.complete, reader.nbytes) == (True, 4 * values.size)

    coded = ChunkReader(values.size, "fragment 0", INT8)
    through_a_socket_pair(lambda conn: send_frames(conn, values, INT8), coded, out)
    assert np.abs(out - values).max() <= np.abs(values).max() / 127


def test_a_damaged_frame_fails_its_checksum() -> None:
    values = np.ones(1 << 20, np.float32)  # exactly one 4 MiB frame
    data = values.tobytes()
    frame = bytearray(HEAD.pack(0, values.size, len(data), 1.0, checksum(data)) + data)
    frame[HEAD.size + 12345] ^= 0xFF  # one byte flipped on the way
    with pytest.raises(BulkError) as corrupt:
        through_a_socket_pair(lambda conn: conn.sendall(frame),
                              ChunkReader(values.size, "fragment 0"), np.zeros_like(values))
    assert corrupt.value.reason == "corrupt"
    assert "frame at offset 0 of fragment 0 fails its checksum" in corrupt.value.message


def test_a_transfer_to_a_peer_that_never_answers_ends_when_it_is_cut() -> None:
    """A partitioned coordinator takes the connection and answers nothing: the worker
    would wait out the pool's 30 s timeout; cutting it from another thread (as a
    learner does when the push's call ends) ends it at once."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        pool, abort = BulkPool("l0"), Abort()
        failed: list[BaseException] = []

        def push() -> None:
            try:
                pool.push("127.0.0.1", port, bytes(16), np.ones(8, np.float32), FP32, abort)
            except (OSError, ConnectionError) as exc:
                failed.append(exc)

        worker = threading.Thread(target=push)
        worker.start()
        conn, _ = silent.accept()  # taken, never answered
        with conn:
            while abort._conn is None:  # the transfer is running on its connection
                threading.Event().wait(0.01)
            abort.cut()
            worker.join(timeout=5)
            assert not worker.is_alive(), "the cut transfer is still waiting"
        assert failed, "the cut transfer did not fail"
        with pytest.raises(ConnectionError, match="abandoned"):
            pool.push("127.0.0.1", port, bytes(16), np.ones(8, np.float32), FP32, abort)
        pool.close()
