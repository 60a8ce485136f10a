"""The LiteLLM comparison's config (bench/litellm_peer.py): what it writes routes the load
generator's requests to the bench upstream and accepts its key. No LiteLLM, no network."""

from __future__ import annotations

import json
from pathlib import Path

from bench import litellm_peer, loadgen


def test_config_routes_the_load_generators_model_and_key_to_the_upstream(tmp_path: Path) -> None:
    path = litellm_peer.write_config(tmp_path / "litellm.yaml", "http://127.0.0.1:9999/v1")

    config = json.loads(path.read_text())  # JSON is YAML: LiteLLM reads it as its config
    body = json.loads(loadgen.chat_body("small", stream=False))
    request = loadgen.build_request("127.0.0.1", 1, b"{}").decode()
    [entry] = config["model_list"]
    assert entry["model_name"] == body["model"]
    assert entry["litellm_params"]["api_base"] == "http://127.0.0.1:9999/v1"
    assert entry["litellm_params"]["model"] == f"openai/{body['model']}"
    assert f"authorization: Bearer {config['general_settings']['master_key']}\r\n" in request
    assert "database_url" not in config["general_settings"]


def test_server_runs_one_worker_on_the_given_port_with_that_config(tmp_path: Path) -> None:
    cmd = litellm_peer.command(tmp_path / "venv", tmp_path / "c.yaml", 4321)

    assert cmd[0] == str(tmp_path / "venv" / "bin" / "litellm")
    assert cmd[cmd.index("--config") + 1] == str(tmp_path / "c.yaml")
    assert cmd[cmd.index("--port") + 1] == "4321"
    assert cmd[cmd.index("--num_workers") + 1] == "1"
    assert litellm_peer.server_env()["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"


def test_a_missing_venv_is_not_taken_for_an_installed_litellm(tmp_path: Path) -> None:
    assert litellm_peer.installed_version(tmp_path / "nothing-here") is None
    assert litellm_peer.default_venv("9.9.9").name == "litellm-9.9.9"
