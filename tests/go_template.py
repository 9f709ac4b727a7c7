"""Go's text/template, the subset the Modelfile's TEMPLATE uses (Ollama renders it with Go's own), to
render it in the suite as Ollama would: text, ``{{- ... -}}`` trimming, quoted strings, ``.Content``,
``.Role``, ``.Prompt``, ``range $i, $_ := .Messages``, ``$last := eq (len (slice $.Messages $i)) 1``,
``if``/``else if``/``else``/``end`` on ``eq A B`` or a variable. Anything else raises."""

from __future__ import annotations

import json
import re

ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.DOTALL)


def render(template: str, data: dict) -> str:
    nodes, i = [], 0
    for match in ACTION.finditer(template):
        text = template[i : match.start()]
        if match.group(1):
            text = text.rstrip()
        if nodes and nodes[-1][0] == "trim_next":
            nodes.pop()
            text = text.lstrip()
        nodes.append(("text", text))
        nodes.append(("action", match.group(2)))
        if match.group(3):
            nodes.append(("trim_next", ""))
        i = match.end()
    tail = template[i:]
    if nodes and nodes[-1][0] == "trim_next":
        nodes.pop()
        tail = tail.lstrip()
    nodes.append(("text", tail))
    body, rest = _parse(nodes, 0)
    assert rest == len(nodes), "unbalanced {{ end }}"
    out: list[str] = []
    _run(body, {"$": data, ".": data}, out)
    return "".join(out)


def _parse(nodes, i):
    """A list of items until an else/end at this level: text, ('out', expr), ('if', [(cond, body)], else), ('range', ...)."""
    body = []
    while i < len(nodes):
        kind, value = nodes[i]
        if kind == "text":
            body.append(("text", value))
            i += 1
        elif value.startswith(("else", "end")):
            return body, i
        elif value.startswith("if "):
            branches, otherwise = [], []
            condition = value[3:]
            while True:
                inner, i = _parse(nodes, i + 1)
                branches.append((condition, inner))
                word = nodes[i][1]
                if word.startswith("else if "):
                    condition = word[8:]
                    continue
                if word == "else":
                    otherwise, i = _parse(nodes, i + 1)
                assert nodes[i][1] == "end", nodes[i]
                i += 1
                break
            body.append(("if", branches, otherwise))
        elif value.startswith("range "):
            header = re.fullmatch(r"range \$(\w+), \$(\w+) := \.Messages", value)
            assert header, value
            inner, i = _parse(nodes, i + 1)
            assert nodes[i][1] == "end"
            i += 1
            body.append(("range", header.group(1), inner))
        elif ":=" in value:
            name, _, expr = value.partition(":=")
            body.append(("set", name.strip(), expr.strip()))
            i += 1
        else:
            body.append(("out", value))
            i += 1
    return body, i


def _run(body, scope, out):
    for item in body:
        if item[0] == "text":
            out.append(item[1])
        elif item[0] == "out":
            out.append(str(_value(item[1], scope)))
        elif item[0] == "set":
            scope[item[1]] = _value(item[2], scope)
        elif item[0] == "if":
            for condition, inner in item[1]:
                if _value(condition, scope):
                    _run(inner, scope, out)
                    break
            else:
                _run(item[2], scope, out)
        else:
            messages = scope["$"]["Messages"]
            for index, message in enumerate(messages):
                _run(item[2], {**scope, ".": message, f"${item[1]}": index, "$Messages": messages}, out)


def _value(expr: str, scope):
    expr = expr.strip()
    if expr.startswith('"'):
        return json.loads(expr)
    if expr.startswith("("):
        assert expr.endswith(")")
        return _value(expr[1:-1], scope)
    words = _words(expr)
    if len(words) > 1:
        args = [_value(w, scope) for w in words[1:]]
        functions = {
            "eq": lambda a, b: a == b,
            "len": len,
            "slice": lambda items, start: items[start:],
            "not": lambda a: not a,
        }
        return functions[words[0]](*args)
    if expr.startswith("$."):
        return scope["$"][expr[2:]]
    if expr.startswith("$"):
        return scope[expr]
    if expr.startswith("."):
        return scope["."][expr[1:]]
    if re.fullmatch(r"-?\d+", expr):
        return int(expr)
    raise ValueError(f"not in the subset: {expr}")


def _words(expr: str) -> list[str]:
    words, depth, current, quoted = [], 0, "", False
    for char in expr:
        if char == '"' and not current.endswith("\\"):
            quoted = not quoted
        if not quoted and char == "(":
            depth += 1
        if not quoted and char == ")":
            depth -= 1
        if char == " " and depth == 0 and not quoted:
            if current:
                words.append(current)
            current = ""
        else:
            current += char
    return [*words, current] if current else words
