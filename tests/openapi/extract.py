"""Regenerate chat_completions.json from OpenAI's openapi.yaml (not part of the test run).

    python tests/openapi/extract.py path/to/openapi.yaml

Keeps only POST /chat/completions: its request body with every $ref inlined (a reference
back into itself becomes `{}`, any JSON value), and its responses reduced to their status
and description, since the test checks the proxy's errors, not the upstream's replies.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).parent
_DROP = ("description", "example", "examples", "x-oaiMeta", "x-oaiExpandable", "title")


def inline(node: Any, components: dict[str, Any], seen: tuple[str, ...] = ()) -> Any:
    if isinstance(node, list):
        return [inline(item, components, seen) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str):
        name = ref.rsplit("/", 1)[-1]
        if name in seen:
            return {}
        return inline(components[name], components, (*seen, name))
    out = {}
    for key, value in node.items():
        if key == "properties":  # names of fields, not schema keywords: keep them all
            out[key] = {name: inline(v, components, seen) for name, v in value.items()}
        elif key not in _DROP:
            out[key] = inline(value, components, seen)
    return out


def main(source: str) -> None:
    spec = yaml.safe_load(Path(source).read_text(encoding="utf-8"))
    components = spec["components"]["schemas"]
    operation = spec["paths"]["/chat/completions"]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    out = {
        "openapi": spec["openapi"],
        "info": {"title": "OpenAI chat completions (extract)", "version": spec["info"]["version"]},
        "servers": [{"url": "/v1"}],
        "paths": {
            "/chat/completions": {
                "post": {
                    "operationId": operation.get("operationId", "createChatCompletion"),
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": inline(body, components)}},
                    },
                    "responses": {"200": {"description": "OK"}},
                }
            }
        },
    }
    target = HERE / "chat_completions.json"
    target.write_text(json.dumps(out, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"wrote {target} ({target.stat().st_size} bytes)")


if __name__ == "__main__":
    main(sys.argv[1])
