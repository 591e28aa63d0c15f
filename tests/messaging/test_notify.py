"""The notifier wakes long-polls from the scheduler's thread and hands over the stored answer."""

import asyncio
import threading

from messaging.notify import Answer, Notifier


def notify_from_another_thread(notifier: Notifier, request_id: str, answer: Answer | None) -> None:
    thread = threading.Thread(target=notifier.notify, args=(request_id, answer))
    thread.start()
    thread.join()


def test_a_watch_is_woken_with_the_answer_from_another_thread():
    notifier, answer = Notifier(), Answer(b"\x01\x02", "application/x-protobuf", None)

    async def poll():
        with notifier.watch("r1") as watch, notifier.watch("r2") as other:
            notify_from_another_thread(notifier, "r1", answer)
            await asyncio.wait_for(watch.finished.wait(), timeout=5)
            return watch.answer, other.finished.is_set()

    got, other_woken = asyncio.run(poll())
    assert got == answer
    assert not other_woken


def test_a_wake_up_without_an_answer_leaves_it_to_the_database():
    notifier = Notifier()

    async def poll():
        with notifier.watch("r1") as watch:
            notify_from_another_thread(notifier, "r1", None)
            await asyncio.wait_for(watch.finished.wait(), timeout=5)
            return watch.answer

    assert asyncio.run(poll()) is None


def test_a_finished_watch_leaves_nothing_behind():
    notifier = Notifier()

    async def poll():
        with notifier.watch("r1"):
            pass

    asyncio.run(poll())
    notifier.notify("r1", Answer(None, None, {"error": "x", "category": "user"}))  # nobody waits: a no-op
    assert not notifier._waiters
