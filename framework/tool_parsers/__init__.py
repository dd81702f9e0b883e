"""Tool-call parsers: a model's output split into content and OpenAI tool calls."""

from framework.tool_parsers.base import (
    CallFormat,
    Delta,
    ParsedOutput,
    ToolCall,
    ToolParser,
    ToolSpec,
    new_call_id,
)

__all__ = ["CallFormat", "Delta", "ParsedOutput", "ToolCall", "ToolParser", "ToolSpec",
           "new_call_id"]
