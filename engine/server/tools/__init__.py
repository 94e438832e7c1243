"""Tool calls: the family of a chat template's call syntax, and the parsers of each family's output."""
from engine.server.tools.family import detect_family
from engine.server.tools.parser import CallDelta, ToolCallParser, parse_tool_calls

__all__ = ["CallDelta", "ToolCallParser", "detect_family", "parse_tool_calls"]
