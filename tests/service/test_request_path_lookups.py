"""The service request path's per-request lookups taken out (issue 26, one process's CPU per request).

* ``proxy._first_done`` replaces ``asyncio.wait(..., return_when=FIRST_COMPLETED)`` in the SGLang
  PD proxy: the expected behaviour is the standard library's own ``asyncio.wait`` (an independent
  implementation), run on the same schedules side by side: which tasks are done when each returns,
  that cancelling the waiter leaves the tasks running, and that no callback is left on them;
* ``Worker.host`` is parsed once per URL: the expected host comes from ``urllib.parse`` (the
  standard library) on the same URLs, including a URL changed after the first read;
* the deadline blocks look the running loop up once (the queue's loop, given to
  ``asyncio.current_task``; on Python 3.11 each lookup was a ``getpid()`` system call, CPython
  gh-100363 removed it in 3.12): a block still expires the task that runs it, not another.
"""

from __future__ import annotations

import asyncio
import random
from urllib.parse import urlparse

import pytest

from balancer.service.config import CircuitBreakerConfig, WorkerConfig
from balancer.service.deadlines import DeadlineQueue
from balancer.service.proxy import _first_done
from balancer.service.workers import CircuitBreaker, Worker


async def _leg(delay_s: float, fail: bool = False) -> str:
    await asyncio.sleep(delay_s)
    if fail:
        raise ValueError("leg failed")
    return "ok"


async def _scripted_leg(fut: asyncio.Future) -> str:
    return await fut  # the driver sets the result (or an exception) at a scripted loop pass


@pytest.mark.parametrize("seed", range(16))
def test_first_done_returns_when_asyncio_wait_does(seed: int) -> None:
    """Two legs ending at scripted loop passes (0-3; sometimes the same pass, sometimes failing):
    ``_first_done`` and ``asyncio.wait(FIRST_COMPLETED)`` on a twin pair with the same script
    return at the same loop pass with the same legs done, and leave no callback on a running leg."""
    rng = random.Random(seed)
    ends = [rng.randrange(4) for _ in range(2)]
    fails = [rng.random() < 0.3 for _ in range(2)]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        futs = {k: [loop.create_future() for _ in range(2)] for k in ("ours", "theirs")}
        legs = {k: [loop.create_task(_scripted_leg(f)) for f in fs] for k, fs in futs.items()}
        passes = {"n": 0}
        seen: dict[str, tuple[int, list[bool]]] = {}

        async def driver() -> None:
            for n in range(6):
                passes["n"] = n
                for i in range(2):
                    if ends[i] == n:
                        for k in futs:
                            if fails[i]:
                                futs[k][i].set_exception(ValueError("leg failed"))
                            else:
                                futs[k][i].set_result("ok")
                await asyncio.sleep(0)

        async def ours() -> None:
            await _first_done(loop, legs["ours"][0], legs["ours"][1])
            seen["ours"] = (passes["n"], [t.done() for t in legs["ours"]])

        async def theirs() -> None:
            await asyncio.wait(legs["theirs"], return_when=asyncio.FIRST_COMPLETED)
            seen["theirs"] = (passes["n"], [t.done() for t in legs["theirs"]])

        await asyncio.gather(driver(), ours(), theirs())
        assert seen["ours"] == seen["theirs"], (ends, fails, seen)
        assert any(seen["ours"][1])
        await asyncio.gather(*legs["ours"], *legs["theirs"], return_exceptions=True)

    asyncio.run(main())


def test_first_done_on_one_task_waits_for_it_alone() -> None:
    """``b`` None: only ``a`` wakes the waiter (the SGLang PD loop once the prefill leg was read)."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        a = loop.create_task(_leg(0.03))
        other = loop.create_task(_leg(0.0))  # done first, but not waited on
        t0 = loop.time()
        await _first_done(loop, a, None)
        assert a.done() and other.done()
        assert loop.time() - t0 >= 0.025

    asyncio.run(main())


def test_first_done_already_done_returns_and_cancel_leaves_legs_running() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_task(_leg(0.0))
        await done
        slow = loop.create_task(_leg(5.0))
        await asyncio.wait_for(_first_done(loop, done, slow), 1.0)  # a done task wakes it at once
        assert not slow.done()
        waiter = loop.create_task(_first_done(loop, slow, None))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert not slow.done() and not slow.cancelled()  # as asyncio.wait: the legs are the caller's
        assert not slow._callbacks  # noqa: SLF001  (asyncio.Task's callbacks: none left by the waiter)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow

    asyncio.run(main())


def _worker(url: str) -> Worker:
    return Worker(WorkerConfig(url=url, role="decode"), CircuitBreaker(CircuitBreakerConfig()))


@pytest.mark.parametrize("url", ["http://10.0.0.5:30000", "http://[::1]:8000", "http://engine-a.local:8000",
                                 "http://127.0.0.1:9"])
def test_worker_host_is_urlparse_hostname(url: str) -> None:
    w = _worker(url)
    want = urlparse(url).hostname  # the standard library's parse, not ours
    assert w.host == want
    assert w.host == want  # the cached value, read again


def test_worker_host_follows_a_changed_url() -> None:
    w = _worker("http://10.0.0.5:30000")
    assert w.host == "10.0.0.5"
    w.cfg = WorkerConfig(url="http://10.0.0.6:30000", role="decode")
    assert w.host == "10.0.0.6"  # parsed again for the new URL, not the first one's


def test_deadline_block_still_cancels_its_own_task_with_the_loop_given() -> None:
    """The block finds the task running it through the queue's loop: a block in one of two tasks
    expires that task only (the other, in a block with a later deadline, finishes)."""
    async def main() -> list[str]:
        q = DeadlineQueue()
        loop = asyncio.get_running_loop()

        async def block(wait_s: float, deadline_in_s: float) -> str:
            try:
                async with q.at(loop.time() + deadline_in_s):
                    await asyncio.sleep(wait_s)
            except TimeoutError:
                return "timeout"
            return "done"

        return await asyncio.gather(block(5.0, 0.02), block(0.05, 1.0))

    assert asyncio.run(main()) == ["timeout", "done"]
