"""balancer.service.deadlines: a queue of deadlines that behaves as ``asyncio.timeout_at``.

The expected behaviour comes from the standard library's ``asyncio.timeout_at`` (an independent
implementation), run side by side on the same schedules, every test on an event loop with a
virtual clock (time advances only while the loop would wait: outcomes and times do not depend on
the host's load)."""

from __future__ import annotations

import asyncio
import random
import selectors

import pytest

from balancer.service.deadlines import DeadlineQueue


class _VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` is virtual: a wait of ``t`` seconds for the next timer
    returns at once with the clock ``t`` later (nothing here waits on real I/O)."""

    def __init__(self) -> None:
        self.now_s = 1000.0
        loop = self

        class _Selector(selectors.DefaultSelector):
            def select(self, timeout=None):  # noqa: ANN001, ANN202
                if timeout:
                    loop.now_s += timeout
                return super().select(0)

        super().__init__(_Selector())

    def time(self) -> float:
        return self.now_s


def _run(coro):  # noqa: ANN001, ANN202
    """``coro`` to completion on a fresh virtual-clock loop."""
    loop = _VirtualClockLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


async def _block(cm, run_s: float) -> str:  # noqa: ANN001
    """``run_s`` of sleeping inside ``cm``: "done", "timeout" or "cancelled"."""
    try:
        async with cm:
            await asyncio.sleep(run_s)
        return "done"
    except TimeoutError:
        return "timeout"


def test_expires_at_the_deadline_like_timeout_at():
    async def main():
        loop = asyncio.get_running_loop()
        q = DeadlineQueue()
        t0 = loop.time()
        got = await _block(q.after(0.05), 5.0)
        elapsed = loop.time() - t0
        assert got == "timeout"
        assert elapsed == pytest.approx(0.05)  # fired at its deadline, not after the 5 s sleep
        assert len(q) == 0 and q.queued == 1 and q.fallbacks == 0
        assert await _block(q.after(1.0), 0.01) == "done"  # a block that ends in time: no timeout
        assert len(q) == 0

    _run(main())


def test_timeout_error_is_raised_from_the_cancellation():
    async def main():
        q = DeadlineQueue()
        with pytest.raises(TimeoutError) as e:
            async with q.after(0.01):
                await asyncio.sleep(1.0)
        assert isinstance(e.value.__cause__, asyncio.CancelledError)  # as asyncio.timeout
        assert asyncio.current_task().cancelling() == 0  # the cancellation it asked for was taken back

    _run(main())


def test_same_outcomes_as_timeout_at_on_random_schedules():
    """Blocks with random deadlines (in order and out of order) and run times at least 0.01 s away
    from them: every block ends as the same block under asyncio.timeout_at does (virtual clock)."""
    rng = random.Random(26)

    async def main():
        loop = asyncio.get_running_loop()
        for _ in range(20):
            q = DeadlineQueue()
            t0 = loop.time()
            plan = []
            for _ in range(50):
                deadline = rng.uniform(0.0, 0.4)
                run = deadline + rng.choice([-1, 1]) * rng.uniform(0.01, 0.2)
                plan.append((rng.uniform(0.0, 0.1), deadline, max(0.0, run)))

            async def one(start, deadline, run, cm_of):  # noqa: ANN001, ANN202
                await asyncio.sleep(start)
                return await _block(cm_of(t0 + start + deadline), run)

            ours = [asyncio.create_task(one(s, d, r, q.at)) for s, d, r in plan]
            ref = [asyncio.create_task(one(s, d, r, asyncio.timeout_at)) for s, d, r in plan]
            got, want = await asyncio.gather(*ours), await asyncio.gather(*ref)
            assert got == want
            assert want.count("timeout") and want.count("done")  # both kinds occur
            assert len(q) == 0
            assert q.fallbacks > 0  # some came out of order (a timer of their own)

    _run(main())


def test_a_later_shorter_deadline_is_not_held_up_by_an_earlier_longer_one():
    async def main():
        loop = asyncio.get_running_loop()
        q = DeadlineQueue()
        long = asyncio.create_task(_block(q.after(5.0), 10.0))
        await asyncio.sleep(0)
        t0 = loop.time()
        assert await _block(q.after(0.05), 5.0) == "timeout"
        assert loop.time() - t0 < 1.0  # not at the long block's 5 s
        assert q.fallbacks == 1
        long.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long
        assert len(q) == 0

    _run(main())


def test_a_block_that_left_does_not_expire_the_next_early():
    async def main():
        loop = asyncio.get_running_loop()
        q = DeadlineQueue()
        assert await _block(q.after(0.05), 0.0) == "done"  # its timer stays set for 0.05 s
        t0 = loop.time()
        assert await _block(q.after(0.3), 0.15) == "done"  # past the stale timer, inside its own deadline
        assert await _block(q.after(0.1), 1.0) == "timeout"
        assert loop.time() - t0 < 1.0

    _run(main())


def test_cancellation_by_someone_else_propagates():
    async def main():
        q = DeadlineQueue()
        # cancelled before its deadline: CancelledError, nothing left queued
        t = asyncio.create_task(_block(q.after(5.0), 10.0))
        await asyncio.sleep(0.01)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert len(q) == 0

        # cancelled by someone else as well as by its (passed) deadline: CancelledError, as asyncio.timeout_at
        async def both(cm):  # noqa: ANN001, ANN202
            async with cm:
                asyncio.current_task().cancel()  # someone else's cancellation
                await asyncio.sleep(1.0)

        loop = asyncio.get_running_loop()
        for make in (q.at, asyncio.timeout_at):
            t = asyncio.create_task(both(make(loop.time() - 1.0)))
            with pytest.raises(asyncio.CancelledError):
                await t
        assert len(q) == 0

    _run(main())


def test_nested_blocks():
    async def main():
        q = DeadlineQueue()
        inner = DeadlineQueue()
        # the inner deadline first: caught inside, the outer block goes on
        async with q.after(1.0):
            assert await _block(inner.after(0.02), 1.0) == "timeout"
            await asyncio.sleep(0.01)
        # the outer deadline first: passes through the inner block (asyncio.timeout_at) as a cancellation
        with pytest.raises(TimeoutError):
            async with q.after(0.02):
                try:
                    async with asyncio.timeout_at(asyncio.get_running_loop().time() + 5.0):
                        await asyncio.sleep(1.0)
                except TimeoutError:  # pragma: no cover - would be the inner one's: wrong
                    pytest.fail("the outer deadline was taken for the inner one's")

    _run(main())


def test_a_passed_deadline_expires_at_the_first_wait():
    async def main():
        q = DeadlineQueue()
        loop = asyncio.get_running_loop()
        assert await _block(q.at(loop.time() - 1.0), 1.0) == "timeout"
        assert await _block(asyncio.timeout_at(loop.time() - 1.0), 1.0) == "timeout"

    _run(main())


def test_outside_a_task_is_refused():
    q = DeadlineQueue()

    async def enter():  # noqa: ANN202
        return await q.at(0.0).__aenter__()

    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(RuntimeError, match="inside a task"):
            loop.run_until_complete(_no_task(loop, enter()))
    finally:
        loop.close()


def _no_task(loop: asyncio.AbstractEventLoop, coro):  # noqa: ANN001, ANN202
    """``coro`` run by the loop but outside any task (driven by hand)."""
    fut = loop.create_future()

    def drive() -> None:
        try:
            coro.send(None)
        except StopIteration as e:
            fut.set_result(e.value)
        except BaseException as e:  # noqa: BLE001
            fut.set_exception(e)

    loop.call_soon(drive)
    return fut


def test_first_byte_queues_one_per_kind_and_bounded():
    """Proxy._first_byte_queue: one queue per (stream, max_out) (their deadlines have one length),
    at most FIRST_BYTE_QUEUES; idle ones make room, busy ones send new kinds to the overflow queue."""
    from types import SimpleNamespace

    from balancer.service.proxy import FIRST_BYTE_QUEUES, Proxy

    fake = SimpleNamespace(_first_byte_deadlines={}, _first_byte_overflow=DeadlineQueue())
    pick = Proxy._first_byte_queue
    a, b = pick(fake, False, 8), pick(fake, True, 8)
    assert a is pick(fake, False, 8) and a is not b and b is not fake._first_byte_overflow
    busy = [pick(fake, False, k) for k in range(100, 100 + FIRST_BYTE_QUEUES - 2)]
    assert len(fake._first_byte_deadlines) == FIRST_BYTE_QUEUES
    for q in [a, b, *busy]:
        q._entries[object()] = None  # a block waiting in every queue: none can be dropped
    assert pick(fake, False, 7) is fake._first_byte_overflow
    assert len(fake._first_byte_deadlines) == FIRST_BYTE_QUEUES
    a._entries.clear()  # one idle queue: dropped for the new kind
    c = pick(fake, False, 7)
    assert c is not fake._first_byte_overflow and len(fake._first_byte_deadlines) == FIRST_BYTE_QUEUES
    assert (False, 8) not in fake._first_byte_deadlines and (True, 8) in fake._first_byte_deadlines
