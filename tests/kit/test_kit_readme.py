"""The testing kit page's examples (docs/testing-kit.md) run as written, and the plugin is
active only when asked."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.kit.external import kit_example, run_pytest


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's project: the kit page's first example as its only test file."""
    (tmp_path / "test_kit_example.py").write_text(kit_example(), encoding="utf-8")
    return tmp_path


def test_the_kit_example_passes_with_the_plugin_opted_in(project: Path) -> None:
    done = run_pytest(sys.executable, project, "-p", "compaction_proxy")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


def test_the_kit_sync_client_example_passes(tmp_path: Path) -> None:
    (tmp_path / "test_sync_example.py").write_text(kit_example(1), encoding="utf-8")
    done = run_pytest(sys.executable, tmp_path, "-p", "compaction_proxy")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


# Only the fixtures' presence: quicker than the example, which builds the tokenizer.
FIXTURES_ONLY = """
def test_the_fixtures_are_there(fake_openai, compaction_proxy_settings):
    assert fake_openai.base_url == compaction_proxy_settings.upstream.base_url
"""


def test_pytest_plugins_in_conftest_opts_in_too(tmp_path: Path) -> None:
    (tmp_path / "test_fixtures.py").write_text(FIXTURES_ONLY)
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["proxy.testing.plugin"]\n')
    done = run_pytest(sys.executable, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


def test_addopts_opts_in_even_with_plugin_autoload_disabled(tmp_path: Path) -> None:
    # Autoload off: pytest loads only what -p names, the entry point found by its name.
    (tmp_path / "test_fixtures.py").write_text(FIXTURES_ONLY)
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p compaction_proxy\n")
    done = run_pytest(sys.executable, tmp_path, env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


def test_without_opting_in_the_plugin_registers_nothing(project: Path) -> None:
    done = run_pytest(sys.executable, project)
    assert done.returncode != 0
    assert "fixture 'openai_client' not found" in done.stdout, done.stdout
    available = done.stdout.split("available fixtures:", 1)[1].split("\n\n", 1)[0]
    for name in ("fake_openai", "proxy_app", "proxy_client", "openai_client", "compaction_proxy"):
        assert name not in available
    assert "Unknown pytest.mark.compaction_proxy" in done.stdout  # no marker registered either


def test_without_opting_in_a_kit_fixture_error_says_how_to_opt_in(project: Path) -> None:
    done = run_pytest(sys.executable, project)
    assert done.returncode != 0
    # Under the error itself, and once more in the run's summary.
    assert "- compaction-proxy -" in done.stdout, done.stdout
    assert "openai_client: a fixture of compaction-proxy's testing kit" in done.stdout
    assert "pytest -p compaction_proxy" in done.stdout
    assert 'pytest_plugins = ["proxy.testing.plugin"]' in done.stdout
    summary = done.stdout.split("= compaction-proxy =", 1)[1]
    assert "openai_client" in summary


OTHER_MISSING = """
import pytest

@pytest.fixture
def openai_client():
    return "the project's own"

def test_own_fixture(openai_client):
    assert openai_client == "the project's own"

def test_missing(no_such_fixture):
    pass
"""


def test_the_hint_leaves_other_fixtures_and_a_projects_own_alone(tmp_path: Path) -> None:
    (tmp_path / "test_own.py").write_text(OTHER_MISSING)
    done = run_pytest(sys.executable, tmp_path)
    assert "1 passed, 1 error" in done.stdout, done.stdout
    assert "fixture 'no_such_fixture' not found" in done.stdout
    assert "compaction-proxy" not in done.stdout


def test_the_hint_knows_every_fixture_the_plugin_defines(tmp_path: Path) -> None:
    from proxy.pytest_entry import KIT_FIXTURES

    done = run_pytest(sys.executable, tmp_path, "-p", "compaction_proxy", "--fixtures")
    section = done.stdout.split("fixtures defined from proxy.testing.plugin", 1)[1]
    defined = set(re.findall(r"^(\w+) -- ", section.split("\n--", 1)[0], re.MULTILINE))
    assert defined == KIT_FIXTURES
