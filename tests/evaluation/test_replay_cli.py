"""`compaction-proxy replay` as a user runs it: outputs, bad input, a session failing
midway, Ctrl-C."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from proxy.cli import main
from proxy.replay import plots
from proxy.replay.measure import RunMeasure
from proxy.testing import FAKE_UPSTREAM, FakeOpenAI
from tests.evaluation.replaying import SESSIONS, SHIPPED


def run_cli(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exit:
        main(["replay", *argv])
    return int(exit.value.code or 0)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_replay_writes_the_report_the_tables_and_the_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeOpenAI(summary_tokens=200)
    out = tmp_path / "out"
    support = str(SESSIONS / "support-chat.jsonl.xz")
    with fake.mock():
        code = run_cli([support, "--strategy", "simple,structured", "--budget", "6000",
                        "--summarizer-url", FAKE_UPSTREAM, "--out", str(out)])  # fmt: skip
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["complete"] is True
    assert [(r["strategy"], r["budget"]) for r in report["runs"]] == [
        ("none", None), ("simple", 6000), ("structured", 6000)
    ]  # fmt: skip
    assert [r["strategy"] for r in report["summary"]] == ["none", "simple", "structured"]
    markdown = (out / "report.md").read_text()
    assert "| simple | 6,000 |" in markdown and "| structured | 6,000 |" in markdown
    printed = capsys.readouterr()
    assert "| simple | 6,000 |" in printed.out  # the summary table, on standard output
    if plots.available():
        assert (out / "tokens.png").read_bytes()[:4] == b"\x89PNG"
        assert (out / "cost-recall.png").read_bytes()[:4] == b"\x89PNG"
        assert "![tokens](tokens.png)" in markdown


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}\nnot json\n',
         "line 2: not JSON"),
        (b'{"model": "m", "messages": []}\n', "line 1: not a chat completions request"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}\n', "no `model`"),
        (b"\n\n", "no requests"),
    ],
)  # fmt: skip
def test_bad_sessions_get_one_clear_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, words: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    assert run_cli([str(path), "--summarizer-url", FAKE_UPSTREAM, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--strategy", "nonesuch"], "unknown strategy 'nonesuch'"),
        (["--strategy", "no.such.module:Factory"], "cannot import"),
        (["--budget", "0"], "--budget: '0' is not a positive number"),
        (["--judge-url", FAKE_UPSTREAM], "--judge-url and --judge-model go together"),
        (["--summarizer-key-env", "NO_SUCH_VARIABLE_HERE"], "NO_SUCH_VARIABLE_HERE is not set"),
    ],
)
def test_bad_options_get_one_clear_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    support = str(SESSIONS / "support-chat.jsonl.xz")
    with FakeOpenAI().mock():
        code = run_cli([support, "--summarizer-url", FAKE_UPSTREAM, *argv, "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "report.json").exists()


def test_an_unreachable_summarizer_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"
    assert run_cli([SHIPPED[0], "--summarizer-url", url, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--summarizer-url: cannot reach" in err and err.count("\n") == 1


def test_a_session_failing_midway_is_reported_and_the_others_go_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text("[tokenizer]\nmax_request_tokens = 20000\n")  # research-agent grows past
    out = tmp_path / "out"
    with FakeOpenAI().mock():
        code = run_cli([*SHIPPED, "--config", str(config), "--budget", "8000",
                        "--summarizer-url", FAKE_UPSTREAM, "--out", str(out)])  # fmt: skip
    assert code == 1
    report = json.loads((out / "report.json").read_text())
    by_session: dict[str, set[str]] = {}
    for run in report["runs"]:
        by_session.setdefault(run["session"], set()).add(run["status"])
    assert by_session["research-agent"] == {"failed"}
    assert by_session["support-chat"] == {"ok"}
    failed = next(r for r in report["runs"] if r["session"] == "research-agent")
    assert failed["error"].startswith("turn ") and "20000" in failed["error"]
    assert failed["turns"] == int(failed["error"].split()[1].rstrip(":"))  # turns before it
    assert "failed: research-agent" in capsys.readouterr().err


def test_ctrl_c_writes_what_is_done(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    added = RunMeasure.add
    seen: list[int] = []

    def interrupt_in_the_second_run(self: RunMeasure, turn: Any) -> Any:
        if self.budget is not None:  # the baseline ran first and is done
            seen.append(1)
            if len(seen) == 3:
                raise KeyboardInterrupt
        return added(self, turn)

    monkeypatch.setattr(RunMeasure, "add", interrupt_in_the_second_run)
    out = tmp_path / "out"
    support = str(SESSIONS / "support-chat.jsonl.xz")
    with FakeOpenAI().mock():
        code = run_cli([support, "--budget", "6000", "--summarizer-url", FAKE_UPSTREAM,
                        "--out", str(out)])  # fmt: skip
    assert code == 130
    report = json.loads((out / "report.json").read_text())
    assert report["complete"] is False
    assert [r["strategy"] for r in report["runs"]] == ["none"]
    assert "Incomplete" in (out / "report.md").read_text()
    assert "interrupted" in capsys.readouterr().err
