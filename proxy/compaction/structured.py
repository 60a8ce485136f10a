"""StructuredCompaction: SimpleCompaction's cut and store, a fixed summary template.

The summarizer is asked for goal / constraints and decisions / done / open items / key facts
(paths, identifiers, numbers, URLs, error messages copied verbatim). When a stored summary is
extended, it is given back as message 1 and updated section by section, so facts survive
repeated extensions instead of being re-paraphrased each time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from proxy.compaction.prompt import (
    STRUCTURED_EXTEND_PROMPT,
    STRUCTURED_PROMPT,
    STRUCTURED_PROMPT_VERSION,
    compact_prompt,
)
from proxy.compaction.render import Body, compose
from proxy.compaction.simple import SimpleCompaction


class StructuredCompaction(SimpleCompaction):
    name = "structured"
    prompt_version = STRUCTURED_PROMPT_VERSION

    def _compose(self, bodies: list[Body], instruction: str, previous: str | None) -> str:
        prompt = STRUCTURED_PROMPT if previous is None else STRUCTURED_EXTEND_PROMPT
        return compose(bodies, instruction, prompt)

    def _prompt_tokens(self) -> int:
        return max(
            self.count_tokens(compact_prompt(self.custom_instruction, prompt))
            for prompt in (STRUCTURED_PROMPT, STRUCTURED_EXTEND_PROMPT)
        )


if TYPE_CHECKING:
    from proxy.compaction.protocol import Summarizing

    _check: Summarizing = StructuredCompaction()
