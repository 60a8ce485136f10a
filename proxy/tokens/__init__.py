"""Prompt token counting that matches what OpenAI bills."""
