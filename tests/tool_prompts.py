"""Tool-use prompts of our own with their tools: the agents test and tests/perf/tool_calls_share.py."""
from __future__ import annotations


def _fn(name: str, description: str, props: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required}}}


S = {"type": "string"}
TOOLS = [
    _fn("get_weather", "Current weather of a city", {"city": S, "unit": {"type": "string", "enum": ["C", "F"]}},
        ["city"]),
    _fn("search_web", "Search the web", {"query": S, "max_results": {"type": "integer"}}, ["query"]),
    _fn("send_email", "Send an email", {"to": S, "subject": S, "body": S}, ["to", "subject", "body"]),
    _fn("convert_currency", "Convert an amount between currencies",
        {"amount": {"type": "number"}, "from_currency": S, "to_currency": S}, ["amount", "from_currency", "to_currency"]),
    _fn("create_event", "Add an event to the calendar", {"title": S, "date": S, "time": S}, ["title", "date"]),
]
# (prompt, the tool a right answer calls)
PROMPTS = [
    ("What's the weather in Paris right now?", "get_weather"),
    ("Is it raining in Tokyo? Give me the temperature in F.", "get_weather"),
    ("Search the web for the latest Python release notes.", "search_web"),
    ("Find me 3 articles about ternary neural networks.", "search_web"),
    ("Email bob@example.com with subject 'Lunch' and say I'm running late.", "send_email"),
    ("Send alice@example.org an email titled 'Report' saying the report is attached.", "send_email"),
    ("How much is 250 US dollars in euros?", "convert_currency"),
    ("Convert 1000 JPY to GBP.", "convert_currency"),
    ("Put 'Dentist' on my calendar for 2026-12-10 at 09:30.", "create_event"),
    ("Schedule a meeting called 'Sprint review' on 2027-01-05.", "create_event"),
    ("What's the weather like in Berlin today, in Celsius?", "get_weather"),
    ("Look up who won the 2018 World Cup.", "search_web"),
    ("Tell carol@example.net by email that the build is green; subject 'CI'.", "send_email"),
    ("I have 80 Swiss francs. How many dollars is that?", "convert_currency"),
    ("Add 'Mom's birthday' to my calendar on 2027-03-14.", "create_event"),
    ("Weather in New York City, please.", "get_weather"),
    ("Search for a good recipe for banana bread.", "search_web"),
    ("Convert 42.5 euros to Canadian dollars.", "convert_currency"),
    ("Create an event 'Gym' on 2026-12-03 at 18:00.", "create_event"),
    ("Write to dave@example.com, subject 'Invoice', body 'Please find the invoice enclosed.'", "send_email"),
]
