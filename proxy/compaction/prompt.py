"""The texts the summarizer sees, and the version that caches key on.

Any change to a text here changes what a summary of the same span would look like, so it must
bump PROMPT_VERSION: stored summaries made under another version are then not reused.
"""

from __future__ import annotations

PROMPT_VERSION = "v1"
STRUCTURED_PROMPT_VERSION = "structured-v1"

# Exactly the reference's system prompt for the summarization call.
SYSTEM_PROMPT = "You are a helpful assistant that compacts conversation context."

# The summary message starts with this, as in the reference.
SUMMARY_MARKER = (
    "<system>Previous context has been compacted. Here is the compaction output:</system>"
)

# One serialized message: the header, then the message's text.
MESSAGE_HEADER = "## Message {index}\nRole: {role}\nContent:\n"

COMPACT_PROMPT = """\
The messages above are part of a conversation between a user and an AI agent that uses tools.
Compact them into a summary the agent can continue working from without the original messages.

Keep, in this order of priority:
1. The current task and exactly where it stands: what was asked, what is done, what comes next.
2. Errors met and how they were solved, including the exact messages and stack traces that matter.
3. The final version of code that was written or changed; drop intermediate attempts.
4. System context: project structure, dependencies, environment, commands, paths, versions.
5. Design decisions and the reasons behind them.
6. Open TODO items and unanswered questions.

Rules:
- Never drop errors, stack traces, working solutions or the current task.
- Merge discussions of the same topic into one entry.
- Remove repetition and failed attempts, but keep the lesson each failure taught.
- Condense long code to signatures and key logic; keep code under about 20 lines whole.
- Be specific: names, paths, numbers and identifiers, not vague descriptions.

Answer with exactly this structure:

<current_focus>
What is being worked on right now and the next step.
</current_focus>

<environment>
Project layout, languages, dependencies, tools and settings that matter.
</environment>

<completed_tasks>
- Each finished task and its outcome.
</completed_tasks>

<active_issues>
- Each open problem: symptom, cause if known, what was tried.
</active_issues>

<code_state>
<file path="...">
<summary>What this file does and how it changed.</summary>
<key_elements>Important functions, classes, fields and their signatures.</key_elements>
<latest_snippets>The latest critical code, verbatim.</latest_snippets>
</file>
</code_state>

<important_context>
Anything else the agent must know to continue: user preferences, constraints, decisions.
</important_context>"""

CUSTOM_INSTRUCTION_BLOCK = """

**The user's own instruction for this compaction:**
The user asked for the following focus. It takes priority over the default priorities above:
{instruction}"""


def compact_prompt(custom_instruction: str = "", prompt: str = COMPACT_PROMPT) -> str:
    """The text placed after the serialized messages, with the user's focus block if any."""
    instruction = custom_instruction.strip()
    if not instruction:
        return prompt
    return prompt + CUSTOM_INSTRUCTION_BLOCK.format(instruction=instruction)


def message_header(index: int, role: str) -> str:
    return MESSAGE_HEADER.format(index=index, role=role)


_TEMPLATE = """\
## Goal
What the user wants, in their terms; the current task and its next step.

## Constraints and decisions
- Each requirement, preference or limit, and each decision taken with its reason.

## Done
- Each finished step and its outcome.

## Open items
- Each unfinished step, open question or known problem (symptom, cause if known).

## Key facts
- Copied character for character, one per line: file paths, identifiers (functions,
  classes, variables, ids), numbers and versions, URLs, commands, error messages."""

STRUCTURED_PROMPT = f"""\
The messages above are part of a conversation between a user and an AI agent that uses tools.
Summarize them so the agent can continue without the original messages.

Answer with exactly this template: keep every heading, write "- none" under an empty one, add
no other sections. Be specific; drop repetition and failed attempts but keep their lesson.

{_TEMPLATE}"""

STRUCTURED_EXTEND_PROMPT = f"""\
Message 1 above is the summary so far, in the template below; the messages after it came later.
Update the summary section by section and answer with the whole updated summary:
- Goal: keep it, unless the user changed or refined it.
- Constraints and decisions: keep every entry; add the new ones.
- Done: keep every entry; add what was finished since.
- Open items: remove what is now done; add the new ones.
- Key facts: keep every line exactly as it is; add the new facts, verbatim.

{_TEMPLATE}"""
