"""Which encoding and which billing constants a model name implies.

Client model names come in many spellings (`gpt-4o-2024-08-06`, `openai/gpt-4o`,
`ft:gpt-4o-mini:org::id`); we reduce them to a base name and match families by prefix, so a
new dated snapshot works without a code change. Unknown names get the configured default:
counting must never fail because of a model name.
"""

from __future__ import annotations

import re

from proxy.settings import Settings
from proxy.tokens.encodings import EncodingName

_SEP = r"(?:$|[-_:@])"
_O200K = re.compile(
    r"^(?:gpt-4o|chatgpt-4o|gpt-4\.1|gpt-4\.5|gpt-5(?:\.\d+)?|o1|o3|o4|gpt-oss|codex"
    r"|computer-use)" + _SEP
)
_CL100K = re.compile(
    r"^(?:gpt-4|gpt-3\.5|gpt-35|text-embedding-3|text-embedding-ada-002|davinci-002|babbage-002)"
    + _SEP
)
_GPT_4O_MINI = re.compile(r"^gpt-4o-mini" + _SEP)


def base_model(model: str) -> str:
    """`openai/gpt-4o` -> `gpt-4o`; `ft:gpt-4o-mini-2024-07-18:org::id` -> its base model."""
    name = model.strip().lower()
    for _ in range(4):  # a provider prefix around a fine-tune, or the other way round
        name = name.rsplit("/", 1)[-1]
        if not name.startswith("ft:"):
            break
        name = name[3:].split(":", 1)[0]
    return name


def builtin_encoding(model: str) -> EncodingName | None:
    name = base_model(model)
    if _O200K.match(name):
        return "o200k_base"
    if _CL100K.match(name):
        return "cl100k_base"
    return None


def encoding_for(model: str, settings: Settings) -> EncodingName:
    """Config override (`[models."name"] encoding`) first, then the family, then the default."""
    for key in (model, base_model(model)):
        override = settings.models.get(key)
        if override is not None and override.encoding is not None:
            return override.encoding
    found = builtin_encoding(model)
    if found is not None:
        return found
    return settings.tokenizer.default_encoding


def is_gpt_4o_mini(model: str) -> bool:
    """gpt-4o-mini bills images at ~33x the tokens of gpt-4o (same price per image)."""
    return _GPT_4O_MINI.match(base_model(model)) is not None


def known_models(settings: Settings) -> list[str]:
    """The model names the configuration itself names: `[models."name"]` overrides,
    `[compaction.models."name"]` budgets and the summarizer's model (sorted; none guessed)."""
    names = {*settings.models, *settings.compaction.models}
    if settings.compaction.summarizer.model:
        names.add(settings.compaction.summarizer.model)
    return sorted(names)


def preload_encodings(settings: Settings) -> set[EncodingName]:
    """What to build at start: `tokenizer.preload`, or else what the configuration names
    (the default, per-model overrides, the summarizer model's): requests for other families
    build theirs on first use."""
    config = settings.tokenizer
    if config.preload is not None:
        return set(config.preload)
    wanted: set[EncodingName] = {config.default_encoding}
    wanted.update(m.encoding for m in settings.models.values() if m.encoding is not None)
    summarizer = settings.compaction.summarizer.model
    if summarizer:
        wanted.add(encoding_for(summarizer, settings))
    return wanted
