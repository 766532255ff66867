"""Usage metering: in-memory records, flushes that never lose or double an increment."""

from __future__ import annotations

import asyncio
import datetime

import pytest
from asgiref.sync import sync_to_async

from router import keys, usage
from router.keys import KeyInfo
from router.models import ApiKey, UsageRecord

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("close_db_after")]

HOUR = 490_000 * 3600  # some hour of the Unix time


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _hour(ts: int) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC)


async def _key(name: str = "app") -> KeyInfo:
    _, plaintext = await sync_to_async(keys.create_key)(name=name, scopes=["chat"])
    info = await sync_to_async(keys.lookup)(plaintext)
    assert info is not None
    return info


async def _rows() -> list[tuple]:
    return await sync_to_async(
        lambda: list(
            UsageRecord.objects.order_by("hour", "model").values_list(
                "key_id", "key_prefix", "model", "hour", "requests", "prompt_tokens",
                "completion_tokens",
            )
        )
    )()  # fmt: skip


async def test_records_and_flushes_per_key_model_and_hour() -> None:
    clock = Clock(HOUR + 100)
    meter = usage.UsageMeter(clock=clock)
    key = await _key()
    meter.record(key, "m", prompt_tokens=10, completion_tokens=5)
    meter.record(key, "m", prompt_tokens=7, completion_tokens=3)
    meter.record(key, "n", prompt_tokens=1, completion_tokens=-4)  # nonsense counts as 0
    clock.now = HOUR + 3600 + 1
    meter.record(key, "m", prompt_tokens=2, completion_tokens=2)
    assert await meter.flush() == 3
    assert meter.pending() == {}
    assert await _rows() == [
        (key.id, key.prefix, "m", _hour(HOUR), 2, 17, 8),
        (key.id, key.prefix, "n", _hour(HOUR), 1, 1, 0),
        (key.id, key.prefix, "m", _hour(HOUR + 3600), 1, 2, 2),
    ]
    assert await meter.flush() == 0
    meter.record(key, "m", prompt_tokens=1, completion_tokens=1)
    await meter.flush()  # adds into the existing row
    assert (await _rows())[2][4:] == (2, 3, 3)


async def test_concurrent_flushes_write_each_delta_once() -> None:
    meter = usage.UsageMeter(clock=Clock(HOUR))
    other = usage.UsageMeter(clock=Clock(HOUR))  # another web process, same row
    key = await _key()
    for _ in range(5):
        meter.record(key, "m", prompt_tokens=10, completion_tokens=1)
        other.record(key, "m", prompt_tokens=1, completion_tokens=10)
    await asyncio.gather(meter.flush(), meter.flush(), other.flush(), meter.flush())
    assert await _rows() == [(key.id, key.prefix, "m", _hour(HOUR), 10, 55, 55)]


async def test_a_failed_flush_keeps_everything_for_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    meter = usage.UsageMeter(clock=Clock(HOUR))
    key = await _key()
    meter.record(key, "m", prompt_tokens=3, completion_tokens=4)
    real = usage.write_deltas

    def broken(deltas: dict) -> None:
        raise ConnectionError("database away")

    monkeypatch.setattr(usage, "write_deltas", broken)
    with pytest.raises(ConnectionError):
        await meter.flush()
    assert list(meter.pending().values()) == [(1, 3, 4, 0)]
    monkeypatch.setattr(usage, "write_deltas", real)
    await meter.flush()
    assert (await _rows())[0][4:] == (1, 3, 4)


async def test_records_made_during_a_flush_stay_for_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    meter = usage.UsageMeter(clock=Clock(HOUR))
    key = await _key()
    meter.record(key, "m", prompt_tokens=3, completion_tokens=4)
    real = usage.write_deltas

    def slow(deltas: dict) -> None:
        meter.record(key, "m", prompt_tokens=100, completion_tokens=200)  # while writing
        real(deltas)

    monkeypatch.setattr(usage, "write_deltas", slow)
    await meter.flush()
    assert list(meter.pending().values()) == [(1, 100, 200, 0)]
    monkeypatch.setattr(usage, "write_deltas", real)
    await meter.flush()
    assert (await _rows())[0][4:] == (2, 103, 204)


async def test_a_deleted_key_keeps_its_usage_under_its_prefix() -> None:
    meter = usage.UsageMeter(clock=Clock(HOUR))
    key = await _key()
    meter.record(key, "m", prompt_tokens=1, completion_tokens=1)
    await sync_to_async(ApiKey.objects.filter(pk=key.id).delete)()
    await meter.flush()
    await meter.flush()
    meter.record(key, "m", prompt_tokens=1, completion_tokens=1)
    await meter.flush()
    assert await _rows() == [(None, key.prefix, "m", _hour(HOUR), 2, 2, 2)]


async def test_background_flush_and_final_flush_on_stop() -> None:
    meter = usage.UsageMeter(clock=Clock(HOUR), interval=0.05)
    key = await _key()
    meter.start()
    meter.record(key, "m", prompt_tokens=1, completion_tokens=1)
    for _ in range(100):
        await asyncio.sleep(0.05)
        if await _rows():
            break
    assert (await _rows())[0][4:] == (1, 1, 1)
    meter.record(key, "m", prompt_tokens=1, completion_tokens=1)
    await meter.stop()
    assert (await _rows())[0][4:] == (2, 2, 2)
    assert meter.pending() == {}


async def test_processes_racing_to_create_one_row_all_count() -> None:
    """Eight writers at once on a row that does not exist yet: one creates, all add."""
    key = await _key()
    bucket = (key.id, key.prefix, "m", HOUR)
    loop = asyncio.get_running_loop()
    await asyncio.gather(
        *(loop.run_in_executor(None, usage.write_deltas, {bucket: (1, 2, 3, 1)}) for _ in range(8))
    )
    assert await _rows() == [(key.id, key.prefix, "m", _hour(HOUR), 8, 16, 24)]
    errors = await sync_to_async(lambda: UsageRecord.objects.get().errors)()
    assert errors == 8


async def test_csv_streams_under_asgi(admin_key: str) -> None:
    """Under ASGI the export is an async iterator reading batches in Django's thread."""
    import httpx
    from django.core.asgi import get_asgi_application

    key = await _key("exported")
    meter = usage.UsageMeter(clock=Clock(HOUR))
    meter.record(key, "m", prompt_tokens=5, completion_tokens=6)
    await meter.flush()
    transport = httpx.ASGITransport(app=get_asgi_application())
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        day = _hour(HOUR).date().isoformat()
        response = await client.get(
            "/api/usage.csv",
            params={"from": day, "to": day},
            headers={"Authorization": f"Bearer {admin_key}"},
        )
    assert response.status_code == 200, response.text
    assert response.text.splitlines() == [
        ",".join(usage.CSV_HEADER),
        f"{_hour(HOUR):%Y-%m-%dT%H:%M:%SZ},{key.prefix},exported,m,1,5,6,0",
    ]


async def test_a_cancelled_flush_still_subtracts_what_it_wrote(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    meter = usage.UsageMeter(clock=Clock(HOUR))
    key = await _key()
    meter.record(key, "m", prompt_tokens=1, completion_tokens=1)
    real = usage.write_deltas

    def slow(deltas: dict) -> None:
        import time

        time.sleep(0.3)
        real(deltas)

    monkeypatch.setattr(usage, "write_deltas", slow)
    flushing = asyncio.create_task(meter.flush())
    await asyncio.sleep(0.05)
    flushing.cancel()  # as stop() cancels the background loop
    with pytest.raises(asyncio.CancelledError):
        await flushing
    await meter.flush()  # waits for the write under way, then finds nothing left
    assert meter.pending() == {}
    assert (await _rows())[0][4:] == (1, 1, 1)


async def test_a_flush_moves_last_used_at_forward_never_back() -> None:
    clock = Clock(HOUR + 100)
    meter = usage.UsageMeter(clock=clock)
    key = await _key()

    async def last_used() -> datetime.datetime | None:
        return (await ApiKey.objects.aget(pk=key.id)).last_used_at

    assert await last_used() is None
    meter.record(key, "m")
    await meter.flush()
    assert await last_used() == _hour(HOUR + 100)
    # Another web process flushing an older request must not move it back.
    other = usage.UsageMeter(clock=Clock(HOUR + 50))
    other.record(key, "m")
    await other.flush()
    assert await last_used() == _hour(HOUR + 100)
    clock.now = HOUR + 900
    meter.record(key, "m")
    await meter.flush()
    assert await last_used() == _hour(HOUR + 900)
    assert await meter.flush() == 0  # nothing left to write, not even the time


async def test_an_error_counts_beside_its_request() -> None:
    """record_error adds to the request's own bucket: requests stay counted once."""
    meter = usage.UsageMeter(clock=Clock(HOUR))
    key = await _key()
    meter.record(key, "m", prompt_tokens=2, completion_tokens=0)
    meter.record_error(key, "m")
    meter.record(key, "m", prompt_tokens=1, completion_tokens=1)
    assert list(meter.pending().values()) == [(2, 3, 1, 1)]
    await meter.flush()
    rows = await sync_to_async(
        lambda: list(UsageRecord.objects.values_list("requests", "errors"))
    )()
    assert rows == [(2, 1)]
