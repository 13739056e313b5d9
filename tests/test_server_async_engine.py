"""The async engine wrapper alone, on the fake engine of test_server_api."""

from __future__ import annotations

import asyncio

import pytest

from pipeserve.engine.async_engine import AsyncEngine
from pipeserve.sampling_params import SamplingParams
from tests.test_server_api import FakeEngine, _expected_text


def test_async_engine_runs_engine_on_one_thread_and_aborts_on_early_exit():
    fake = FakeEngine()
    engine = AsyncEngine(fake)

    async def main():
        async def whole(i):
            return [o async for o in engine.generate(f"r{i}", {"prompt_token_ids": [1] * (i + 1)},
                                                     SamplingParams(max_tokens=4))][-1]
        outs = await asyncio.gather(*(whole(i) for i in range(8)))
        assert [o.outputs[0].text for o in outs] == [_expected_text(i + 1, 0, 4) for i in range(8)]
        gen = engine.generate("long", {"prompt_token_ids": [1]}, SamplingParams(max_tokens=10_000))
        await gen.__anext__()
        await gen.aclose()  # the caller walks away
        with pytest.raises(ValueError, match="maximum context length"):
            await engine.add_request("big", {"prompt_token_ids": [1] * 100}, SamplingParams())
        for _ in range(100):
            if "long" in fake.aborted:
                break
            await asyncio.sleep(0.01)
    asyncio.run(main())
    engine.shutdown()
    assert fake.aborted == ["long"] and fake.shut_down and not fake.reqs
    assert fake.threads == {"pipeserve-engine"}


def test_a_step_wakes_the_event_loop_once_for_all_its_streams():
    """A step's outputs reach every stream of one event loop in one call_soon_threadsafe (each is
    a write to the loop's self-pipe and a wake-up), in order per stream."""
    fake = FakeEngine(step_s=0.005)
    engine = AsyncEngine(fake)
    streams, tokens = 12, 6

    async def main():
        loop = asyncio.get_running_loop()
        calls = []
        plain = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            calls.append(callback)
            return plain(callback, *args, **kwargs)
        loop.call_soon_threadsafe = counted

        async def whole(i):
            return [o async for o in engine.generate(f"r{i}", {"prompt_token_ids": [1] * (i + 1)},
                                                     SamplingParams(max_tokens=tokens))]
        outs = await asyncio.gather(*(whole(i) for i in range(streams)))
        return calls, outs
    loop = asyncio.SelectorEventLoop()   # asyncio's own, whatever policy a test before set
    try:
        calls, outs = loop.run_until_complete(main())
    finally:
        loop.close()
    engine.shutdown()
    for i, seen in enumerate(outs):
        assert [len(o.outputs[0].token_ids) for o in seen] == list(range(1, tokens + 1))
        assert seen[-1].outputs[0].text == _expected_text(i + 1, 0, tokens)
    # the adds' futures resolve through the loop too (asyncio.wrap_future): one each
    handoffs = len(calls) - streams
    assert tokens <= handoffs <= 2 * tokens + 2, (len(calls), streams)


def test_async_engine_fails_streams_when_step_raises():
    fake = FakeEngine()
    engine = AsyncEngine(fake)

    def boom():
        raise RuntimeError("stage 1 died")
    async def main():
        stream = await engine.add_request("a", {"prompt_token_ids": [1]}, SamplingParams(max_tokens=10_000))
        await stream.__anext__()
        fake.step = boom
        with pytest.raises(RuntimeError, match="stage 1 died"):
            async for _ in stream:
                pass
    asyncio.run(main())
    assert not engine.healthy and "stage 1 died" in engine.error
    engine.shutdown()


def test_shutdown_aborts_open_requests_and_refuses_new_ones():
    from pipeserve.engine.async_engine import EngineDeadError
    fake = FakeEngine(step_s=0.01)
    engine = AsyncEngine(fake)

    async def main():
        stream = await engine.add_request("open", {"prompt_token_ids": [1]}, SamplingParams(max_tokens=10_000))
        await stream.__anext__()
        await asyncio.to_thread(engine.shutdown)
        last = [out async for out in stream][-1]
        assert last.finished and last.outputs[0].finish_reason == "abort"
        with pytest.raises(EngineDeadError, match="shutting down"):
            await engine.add_request("late", {"prompt_token_ids": [1]}, SamplingParams())
    asyncio.run(main())
    assert fake.shut_down and fake.aborted == ["open"] and not engine.healthy
