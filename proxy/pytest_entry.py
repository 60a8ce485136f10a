"""The `pytest11` entry point: registers the testing plugin only when asked to.

pytest imports every installed `pytest11` entry point at start, so a plugin registered there
would add fixtures and markers to every test run of anyone who installs the package. This
module registers nothing unless the run was started with `-p compaction_proxy` (on the command
line, in `addopts` or PYTEST_ADDOPTS); then it loads `proxy.testing.plugin`. It imports
nothing from the proxy otherwise, so a run that does not opt in pays nothing for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

NAME = "compaction_proxy"


def pytest_configure(config: pytest.Config) -> None:
    if NAME in (config.getoption("plugins", None) or []):
        config.pluginmanager.import_plugin("proxy.testing.plugin")
