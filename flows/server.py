"""The Prefect API a `prism` command's flows report to (one temporary server per command).

With `PREFECT_API_URL` unset, Prefect starts a temporary server (`SubprocessASGIServer`) on the
first call that needs its API and stops it at interpreter exit; `stop()` also forgets the
instance. Any call made after that with the URL still unset starts a new server: `get_client()`
(which the log worker's client comes from), `EventsWorker.instance()` (regardless of
`PREFECT_SERVER_ALLOW_EPHEMERAL_MODE`). A slice task still running on a Dask thread while prism
exited logged its failure exactly then, and the server its log started outlived prism.

`command_server` starts that temporary server itself and points `PREFECT_API_URL` at it for the
whole command, so nothing can start a second one: a late call fails against the stopped server.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

_kept: list[ExitStack] = []


@contextmanager
def command_server(final: bool = False) -> Iterator[str]:
    """Yield the API URL the command's flows report to: `PREFECT_API_URL` if set (a running
    server), else that of a temporary server started here and stopped on leaving, once Prefect's
    log and event workers have sent what they hold.

    `final`: the process exits right after (the `prism` command): `PREFECT_API_URL` is left
    pointing at the stopped server, so a thread still reporting during the exit fails instead
    of starting a server that would outlive the process. Otherwise (`main()` called in a test
    process) the settings are restored.
    """
    import prefect.context
    import prefect.main  # noqa: F401 - sets up Prefect's logging (as `from prefect import flow` does)
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

    if PREFECT_API_URL.value():
        yield PREFECT_API_URL.value()
        return
    from prefect.server.api.server import SubprocessASGIServer

    # The default instance: Prefect code asking for SubprocessASGIServer() gets this one (running)
    server = SubprocessASGIServer()
    server.start()
    with ExitStack() as settings:
        # (no UI URL: the server serves none and ends with the command, so no "View at" links)
        settings.enter_context(temporary_settings({PREFECT_API_URL: server.api_url, PREFECT_UI_URL: ""}))
        # threads whose context holds no settings (Prefect's event loop thread, where the log
        # worker makes its client) read the process-global one
        settings.enter_context(_global_settings(prefect.context.get_settings_context()))
        try:
            yield server.api_url
        finally:
            if final:   # keep this server's URL until the process exits (held here: a collected
                _kept.append(settings.pop_all())   # context manager would restore the settings)
            try:
                _drain_workers()
            finally:
                server.stop()


@contextmanager
def _global_settings(context) -> Iterator[None]:
    """Make `context` the process-global settings context (as `prefect_test_harness` does)."""
    import prefect.context

    previous = prefect.context.GLOBAL_SETTINGS_CONTEXT
    prefect.context.GLOBAL_SETTINGS_CONTEXT = context
    try:
        yield
    finally:
        prefect.context.GLOBAL_SETTINGS_CONTEXT = previous


def _drain_workers(timeout: float = 10.0) -> None:
    """Send the logs and events Prefect's workers still hold while the server is up (as
    `prefect_test_harness` does before stopping its server)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout, at_exit=False)
