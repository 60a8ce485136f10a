"""The `pytest11` entry point: registers the testing plugin only when asked to.

pytest imports every installed `pytest11` entry point at start, so a plugin registered there
would add fixtures and markers to every test run of anyone who installs the package. This
module registers nothing unless the run was started with `-p compaction_proxy` (on the command
line, in `addopts` or PYTEST_ADDOPTS); then it loads `proxy.testing.plugin`. It imports
nothing from the proxy otherwise, so a run that does not opt in pays nothing for it.

Without the opt-in, a test asking for one of the kit's fixtures fails with pytest's own
"fixture 'openai_client' not found"; `MissingPluginHint` adds to that error, and to the run's
summary, how to opt in. It defines no fixture, so a project's own fixtures of those names
are untouched.
"""

from __future__ import annotations

import pytest

NAME = "compaction_proxy"
# The fixtures proxy.testing.plugin defines.
KIT_FIXTURES = frozenset(
    {
        "compaction_proxy_settings",
        "fake_openai",
        "proxy_app",
        "proxy_client",
        "openai_client",
        "served_proxy_url",
        "sync_openai_client",
    }
)
HINT = (
    "{names}: a fixture of compaction-proxy's testing kit, whose pytest plugin is not "
    "enabled in this run. Enable it with `pytest -p compaction_proxy`, with "
    '`addopts = "-p compaction_proxy"` in your pytest configuration, or with '
    '`pytest_plugins = ["proxy.testing.plugin"]` in your root conftest.py.'
)


def pytest_configure(config: pytest.Config) -> None:
    if NAME in (config.getoption("plugins", None) or []):
        config.pluginmanager.import_plugin("proxy.testing.plugin")
    else:
        config.pluginmanager.register(MissingPluginHint(), f"{NAME}-hint")


class MissingPluginHint:
    """Says how to enable the plugin when a test asked for a fixture only it defines."""

    def __init__(self) -> None:
        self.missing: set[str] = set()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> object:
        report = yield
        error = call.excinfo.value if call.excinfo is not None else None
        if isinstance(error, pytest.FixtureLookupError) and error.argname in KIT_FIXTURES:
            self.missing.add(error.argname)
            assert isinstance(report, pytest.TestReport)
            report.sections.append(("compaction-proxy", HINT.format(names=error.argname)))
        return report

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.missing:
            terminalreporter.write_sep("=", "compaction-proxy", yellow=True)
            terminalreporter.write_line(HINT.format(names=", ".join(sorted(self.missing))))
