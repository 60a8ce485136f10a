"""Loss measured with a judge model: probes after a compaction, answered twice, scored.

At a compacted turn, the judge reads the full history and writes four probes, one of each
kind (the kinds evaluations of compaction use):

- recall: a specific fact from early on (an error message, a number, a name);
- artifact: which files or objects were created or changed, and how;
- continuation: what the agent should do next;
- decision: a decision that was made, and why.

The answer model answers each probe twice, from the full history and from the forwarded
request, and the judge scores both answers against the probe's reference answer on this
rubric (`RUBRIC`): 5 the same facts, complete and exact; 4 correct, a minor detail missing;
3 partly correct, a key detail missing or vague; 2 mostly wrong or very vague; 1 wrong;
0 no answer or "unknown". A probe the judge wrote no question for gets the kind's generic
question (`GENERIC`); one it wrote no reference answer for is scored against the answer
from the full history. Histories longer than the models' window are shown with each message
cut to its head and tail, the same cut for both answers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from proxy.replay.identifiers import message_text

KINDS = ("recall", "artifact", "continuation", "decision")
GENERIC = {
    "recall": "What was the original error or problem reported, exactly?",
    "artifact": "Which files were changed or created, and how?",
    "continuation": "What is the next step?",
    "decision": "What was decided, and why?",
}
PROBE_PROMPT = """\
Write four questions about the conversation above that test whether someone who read it
still knows what happened, one of each kind, each with its correct answer from the
conversation:
RECALL: a specific fact from early in the conversation (an error message, a number, a name).
ARTIFACT: which files or objects were created or changed, and how.
CONTINUATION: what should be done next.
DECISION: a decision that was made, and its reason.
Answer with exactly these eight lines:
RECALL Q: ...
RECALL A: ...
ARTIFACT Q: ...
ARTIFACT A: ...
CONTINUATION Q: ...
CONTINUATION A: ...
DECISION Q: ...
DECISION A: ..."""
ANSWER_SYSTEM = (
    "Answer the question about the conversation in one or two sentences, with exact names "
    "and numbers. If the conversation does not say, answer: unknown."
)
RUBRIC = """\
5 = the same facts as the reference answer, complete and exact;
4 = correct, a minor detail missing;
3 = partly correct, a key detail missing or vague;
2 = mostly wrong or very vague;
1 = wrong;
0 = no answer, or "unknown"."""
SCORE_SYSTEM = "You grade answers against a reference answer. Reply with: SCORE: <0-5>"
_SCORE = re.compile(r"SCORE\s*[:=]?\s*([0-5])\b", re.IGNORECASE)
_DIGIT = re.compile(r"\b([0-5])\b")


@dataclass(frozen=True)
class ModelEndpoint:
    """An OpenAI-compatible chat model."""

    base_url: str
    model: str
    api_key: str | None = None
    max_tokens: int = 256


class ChatModel:
    """One chat completion per `ask`, over the given client."""

    def __init__(self, client: httpx.AsyncClient, endpoint: ModelEndpoint) -> None:
        self.client = client
        self.endpoint = endpoint

    async def ask(self, system: str, user: str, max_tokens: int | None = None) -> str:
        endpoint = self.endpoint
        headers = {"authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        response = await self.client.post(
            f"{endpoint.base_url.rstrip('/')}/chat/completions",
            json={
                "model": endpoint.model,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": user},
                ],
                "max_tokens": max_tokens or endpoint.max_tokens,
                "temperature": 0,
            },
            headers=headers,
        )
        response.raise_for_status()
        choices = response.json().get("choices") or [{}]
        content = (choices[0].get("message") or {}).get("content")
        return content if isinstance(content, str) else ""


@dataclass(frozen=True)
class Probe:
    kind: str
    question: str
    reference: str | None  # None: scored against the answer from the full history
    generated: bool  # the judge wrote the question (else the kind's generic one)


def parse_probes(text: str) -> list[Probe]:
    """The judge's eight lines as four probes, generic where a question is missing."""
    probes = []
    for kind in KINDS:
        question = _line(text, kind, "Q")
        answer = _line(text, kind, "A")
        probes.append(
            Probe(kind, question or GENERIC[kind], answer if question else None, bool(question))
        )
    return probes


def _line(text: str, kind: str, part: str) -> str | None:
    match = re.search(rf"(?im)^\W*{kind}\W*{part}\W*[:.-]\s*(.+)$", text)
    return match.group(1).strip() if match and match.group(1).strip() else None


def parse_score(text: str) -> int | None:
    match = _SCORE.search(text) or _DIGIT.search(text)
    return int(match.group(1)) if match else None


def render(messages: Sequence[Any], count: Callable[[str], int], limit: int) -> str:
    """The history as text for a model with a `limit`-token window: each message as
    `ROLE: text`, every message cut to the same head and tail length when it must be."""
    texts = [
        f"{m.get('role', '?').upper()}: {message_text(m)}" for m in messages if isinstance(m, dict)
    ]
    whole = "\n\n".join(texts)
    if count(whole) <= limit:
        return whole
    low, high = 40, max(len(t) for t in texts)
    best = "\n\n".join(_cut(t, low) for t in texts)
    while low <= high:  # the largest per-message cap that fits
        middle = (low + high) // 2
        candidate = "\n\n".join(_cut(t, middle) for t in texts)
        if count(candidate) <= limit:
            best, low = candidate, middle + 1
        else:
            high = middle - 1
    if count(best) > limit:  # too many messages even at the smallest cap: the latest ones
        kept = texts[:]
        while len(kept) > 2 and count("\n\n".join(_cut(t, 40) for t in kept)) > limit:
            kept.pop(1)  # keep the first (system or task) and the most recent
        best = "\n\n".join(_cut(t, 40) for t in kept)
    return best


def _cut(text: str, cap: int) -> str:
    if len(text) <= cap:
        return text
    half = cap // 2
    return f"{text[:half]} [...] {text[-half:]}"


class Judge:
    """Probes for one run's compacted turns; the full-history side is shared between runs."""

    def __init__(
        self,
        judge: ChatModel,
        answerer: ChatModel,
        count: Callable[[str], int],
        context_tokens: int,
    ) -> None:
        self.judge = judge
        self.answerer = answerer
        self.count = count
        self.context_tokens = context_tokens
        self._full: dict[tuple[str, int], list[dict[str, Any]]] = {}

    def _conversation(self, messages: Sequence[Any]) -> str:
        # Room for the instructions and the reply.
        limit = max(self.context_tokens - 700, 200)
        return render(messages, self.count, limit)

    async def _score(self, probe: Probe, reference: str, answer: str) -> int | None:
        reply = await self.judge.ask(
            SCORE_SYSTEM,
            f"Question: {probe.question}\nReference answer: {reference}\n"
            f"Candidate answer: {answer}\n\nRubric:\n{RUBRIC}\n\nReply with: SCORE: <0-5>",
            max_tokens=16,
        )
        return parse_score(reply)

    async def _answer(self, probe: Probe, conversation: str) -> str:
        return await self.answerer.ask(
            ANSWER_SYSTEM,
            f"<conversation>\n{conversation}\n</conversation>\n\nQuestion: {probe.question}",
        )

    async def full_side(
        self, key: tuple[str, int], original: Sequence[Any]
    ) -> list[dict[str, Any]]:
        """The probes of one recorded turn, answered and scored from the full history."""
        known = self._full.get(key)
        if known is not None:
            return known
        conversation = self._conversation(original)
        written = await self.judge.ask(
            "You write probe questions about conversations.",
            f"<conversation>\n{conversation}\n</conversation>\n\n{PROBE_PROMPT}",
            max_tokens=400,
        )
        items = []
        for probe in parse_probes(written):
            answer = await self._answer(probe, conversation)
            reference = probe.reference or answer
            items.append(
                {
                    "kind": probe.kind,
                    "question": probe.question,
                    "reference": probe.reference,
                    "generated": probe.generated,
                    "full_answer": answer,
                    "full_score": await self._score(probe, reference, answer),
                    "_probe": probe,
                    "_reference": reference,
                }
            )
        self._full[key] = items
        return items

    async def probe(
        self, key: tuple[str, int], original: Sequence[Any], forwarded: Sequence[Any]
    ) -> list[dict[str, Any]]:
        """Each probe of the turn, answered and scored from both histories."""
        full = await self.full_side(key, original)
        conversation = self._conversation(forwarded)
        results = []
        for item in full:
            probe: Probe = item["_probe"]
            answer = await self._answer(probe, conversation)
            results.append(
                {
                    **{k: v for k, v in item.items() if not k.startswith("_")},
                    "turn": key[1],
                    "compacted_answer": answer,
                    "compacted_score": await self._score(probe, item["_reference"], answer),
                }
            )
        return results


def summarize(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean scores per kind and overall, full history vs compacted."""

    def mean(values: list[int | None]) -> float | None:
        scored = [v for v in values if v is not None]
        return sum(scored) / len(scored) if scored else None

    by_kind = {}
    for kind in KINDS:
        of_kind = [i for i in items if i["kind"] == kind]
        by_kind[kind] = {
            "probes": len(of_kind),
            "full": mean([i["full_score"] for i in of_kind]),
            "compacted": mean([i["compacted_score"] for i in of_kind]),
        }
    return {
        "turns": sorted({i["turn"] for i in items}),
        "by_kind": by_kind,
        "full": mean([i["full_score"] for i in items]),
        "compacted": mean([i["compacted_score"] for i in items]),
        "unscored": sum(1 for i in items if i["compacted_score"] is None),
        "items": list(items),
    }
