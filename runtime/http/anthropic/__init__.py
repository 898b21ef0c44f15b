"""Anthropic's Messages API (`/v1/messages`)."""
