"""Prompt token counting that matches what OpenAI bills."""

from proxy.tokens.commands import register_commands
from proxy.tokens.counter import TokenCounter, TokenizerUnavailable

__all__ = ["TokenCounter", "TokenizerUnavailable", "register_commands"]
