"""Runs one test's work on several threads at once (a module of its own: `conftest` names
two modules in this tree, so importing from it depends on collection order)."""

import threading
from collections.abc import Callable


def run_threads(work: Callable[[int], None], count: int) -> None:
    """Runs `work(0)` ... `work(count - 1)` on as many threads at once; fails with the errors
    any of them raised."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [], errors
