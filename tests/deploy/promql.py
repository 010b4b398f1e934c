"""Which metric names and label names a PromQL expression uses (enough PromQL for our rules and
dashboard: selectors, matchers, ranges, subqueries, offsets, functions, aggregations with
``by``/``without``, vector matching with ``on``/``ignoring``/``group_*``, and Grafana's
variables and ``label_values(...)`` queries)."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Grafana's interval variables stand for a duration; every other variable for a regex value.
_GRAFANA_INTERVAL = re.compile(
    r"\$(?:__rate_interval|__interval|__range)\b|\$\{__(?:rate_)?interval\}"
)
_GRAFANA_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(.*),\s*)?(\w+)\s*\)\s*$", re.DOTALL)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{([^{}]*)\}")
_MATCHER_LABEL = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_DURATION = re.compile(r"(?<![\w:.])(?:\d+(?:ms|[smhdwy]))+(?![\w:])")
_NUMBER = re.compile(r"(?<![\w:.])(?:0x[0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(?![\w:])")
_IDENTIFIER = re.compile(r"[A-Za-z_:][\w:]*")
_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}
    | {"group_left", "group_right", "inf", "nan", "atan2"}
)


@dataclass(frozen=True, slots=True)
class Names:
    metrics: frozenset[str]
    labels: frozenset[str]


def grafana_to_promql(query: str) -> str:
    """A dashboard query as plain PromQL: variables substituted, ``label_values(expr, label)``
    reduced to ``expr`` (``label_values(label)`` to an empty string)."""
    query = _GRAFANA_INTERVAL.sub("5m", query)
    query = _GRAFANA_VARIABLE.sub(".*", query)
    m = _LABEL_VALUES.match(query)
    if m:
        return m.group(1) or ""
    return query


def names(expr: str) -> Names:
    """Metric names and label names (in matchers and grouping clauses) used by ``expr``."""
    labels: set[str] = set()
    text = _STRING.sub('""', expr)

    def matchers(m: re.Match[str]) -> str:
        labels.update(_MATCHER_LABEL.findall(m.group(1)))
        return " "

    def grouping(m: re.Match[str]) -> str:
        labels.update(x.strip() for x in m.group(1).split(",") if x.strip())
        return " "

    text = _MATCHERS.sub(matchers, text)
    while True:  # subqueries may nest ranges: strip innermost first
        stripped = _RANGE.sub(" ", text)
        if stripped == text:
            break
        text = stripped
    text = _GROUPING.sub(grouping, text)
    text = _DURATION.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    metrics = set()
    for m in _IDENTIFIER.finditer(text):
        word = m.group(0)
        if word.lower() in _KEYWORDS:
            continue
        if text[m.end() :].lstrip().startswith("("):
            continue  # a function or an aggregation
        metrics.add(word)
    return Names(frozenset(metrics), frozenset(labels))
