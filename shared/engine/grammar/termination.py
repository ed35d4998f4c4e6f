"""Whether every rule of a grammar can finish: a grammar with a rule that cannot is refused
before any request runs it.

A rule all of whose alternatives need a rule that cannot finish (``root ::= "a" root``; a JSON
schema whose required property is the schema itself, ``{"properties": {"a": {"$ref": "#"}},
"required": ["a"]}``) derives no finite text, and once a request's output enters it, the grammar
forces text that never ends. xgrammar's jump-forward search
(``GrammarMatcher.find_jump_forward_string``, each step of a constrained request) then builds
that text without bound in one C++ call, which the per-request work budget cannot interrupt: a
daemon sent such a schema grew to 24 GB and was killed, every robot's requests with it.

``check_rules_finish`` reads xgrammar's own printed form of the grammar (one normalized syntax
for EBNF, JSON schemas and regexes: ``name ::= ((a b) | (c)) (=(lookahead))``, elements quoted
strings, character classes, rule names, groups, ``*``, ``+``, ``?`` and ``{m, n}``, and the
calls ``Regex(...)``, ``Token(...)``, ``ExcludeToken(...)`` and ``TagDispatch(...)``), computes
the rules that can finish as a fixpoint (a rule finishes if one alternative's elements all can;
a literal, a regex or a token always can; ``*``, ``?`` and ``{0, n}`` can by taking nothing; a
lookahead reads nothing; the rules reached through any of these must finish all the same, since
output can enter them; a tag dispatch can end where its free text may, and the rules it
dispatches to are reached through it), and refuses the grammar if a rule reachable from its
root cannot. What it cannot read is refused too, never passed unchecked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<literal>"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\])
  | (?P<counted>\{\s*(?P<low>\d+)\s*,\s*-?\d+\s*\})
  | (?P<name>[A-Za-z_][\w.-]*)
  | (?P<number>-?\d+)
  | (?P<op>[()|*+?=,])
""", re.VERBOSE)
_RULE_HEAD = re.compile(r"[A-Za-z_][\w.-]* ::= ")
_TERMINAL_CALLS = ("Regex", "Token", "ExcludeToken")  # each matches some text: finishes
_DISPATCH_CALLS = ("TagDispatch", "TokenTagDispatch")  # free text with (tag, rule) pairs: finishes


@dataclass(frozen=True)
class Node:
    """An expression: ``kind`` "text" (finishes), "ref" (``name``), "seq" or "alt" (``parts``),
    or "dispatch" (finishes; ``parts`` the rules it dispatches to)."""

    kind: str
    name: str = ""
    parts: tuple[Node, ...] = ()

    def finishes(self, finishing: set[str]) -> bool:
        """Whether this expression derives some finite text, given the rules that do."""
        if self.kind in ("text", "dispatch"):
            return True
        if self.kind == "ref":
            return self.name in finishing
        if self.kind == "seq":
            return all(part.finishes(finishing) for part in self.parts)
        return any(part.finishes(finishing) for part in self.parts)

    def refs(self) -> set[str]:
        if self.kind == "ref":
            return {self.name}
        return set().union(*(part.refs() for part in self.parts))


_TEXT = Node("text")  # a literal, or what may be taken zero times


def check_rules_finish(printed: str, root: str = "root") -> None:
    """ValueError naming a rule reachable from ``root`` that can never finish, in ``printed``
    (``str()`` of an ``xgrammar.Grammar``). ValueError too for a line it cannot read."""
    rules = _parse_rules(printed)
    finishing: set[str] = set()
    grown = True
    while grown:  # NOTE: last rule first: xgrammar prints a rule before those it uses, so few passes
        grown = False
        for name, body in reversed(rules.items()):
            if name not in finishing and body.finishes(finishing):
                finishing.add(name)
                grown = True
    seen, stack = {root}, [root]
    while stack:
        name = stack.pop()
        if name in rules and name not in finishing:
            raise ValueError(f"the grammar's rule {name!r} can never finish: each of its alternatives needs a rule "
                             "that cannot (itself, directly or through others), so no output could complete it")
        for ref in rules.get(name, _TEXT).refs() - seen:
            seen.add(ref)
            stack.append(ref)


def _parse_rules(printed: str) -> dict[str, Node]:
    texts: dict[str, str] = {}
    name = None
    for line in printed.splitlines():
        if _RULE_HEAD.match(line):
            name, _, body = line.partition(" ::= ")
            texts[name] = body
        elif name is not None:  # a call printed over several lines (TagDispatch)
            texts[name] += "\n" + line
        elif line.strip():
            raise ValueError(f"unreadable grammar line {line[:80]!r}")
    rules = {}
    for name, body in texts.items():
        tokens = _tokens(body)
        node, end = _alternatives(tokens, 0)
        if end != len(tokens):
            raise ValueError(f"unreadable grammar rule {name!r}: unexpected {tokens[end][1]!r}")
        rules[name.strip()] = node
    return rules


def _tokens(body: str) -> list[tuple[str, str, int]]:
    """(kind, text, counted repetition's lower bound) of each token of a rule's body."""
    tokens, at = [], 0
    while at < len(body):
        m = _TOKEN.match(body, at)
        if m is None:
            raise ValueError(f"unreadable grammar text at {body[at:at + 40]!r}")
        if m.lastgroup != "space":
            tokens.append((m.lastgroup, m.group(0), int(m.group("low") or 0)))
        at = m.end()
    return tokens


def _alternatives(tokens: list[tuple[str, str, int]], i: int) -> tuple[Node, int]:
    """The alternatives from token ``i`` to the ``)`` that closes them (or the end)."""
    options, sequence = [], []
    while i < len(tokens) and tokens[i][1] != ")":
        if tokens[i][1] == "|":
            options.append(Node("seq", parts=tuple(sequence)))
            sequence, i = [], i + 1
            continue
        element, i = _element(tokens, i)
        sequence.append(element)
    options.append(Node("seq", parts=tuple(sequence)))
    return Node("alt", parts=tuple(options)), i


def _element(tokens: list[tuple[str, str, int]], i: int) -> tuple[Node, int]:
    """The element at token ``i`` with its repetition."""
    kind, text, _ = tokens[i]
    if kind == "name" and i + 1 < len(tokens) and tokens[i + 1][1] == "(":
        node, i = _call(tokens, i)
    elif text == "(":
        lookahead = i + 1 < len(tokens) and tokens[i + 1][1] == "="
        node, i = _alternatives(tokens, i + (2 if lookahead else 1))
        if i >= len(tokens):
            raise ValueError("unreadable grammar: a group is not closed")
        i += 1
        if lookahead:  # reads nothing, but the rules it names are reached
            return _maybe(node), i
    elif kind in ("literal", "name"):
        node = _TEXT if kind == "literal" else Node("ref", name=text)
        i += 1
    else:
        raise ValueError(f"unreadable grammar: unexpected {text!r}")
    while i < len(tokens) and (tokens[i][1] in ("*", "+", "?") or tokens[i][0] == "counted"):
        kind, text, low = tokens[i]
        if text in ("*", "?") or (kind == "counted" and low == 0):
            node = _maybe(node)
        i += 1
    return node, i


def _maybe(node: Node) -> Node:
    """``node`` or nothing: finishes by taking nothing, and still reaches the rules ``node`` names
    (a rule output can enter through a repetition must be able to leave it)."""
    return Node("alt", parts=(_TEXT, node))


def _call(tokens: list[tuple[str, str, int]], i: int) -> tuple[Node, int]:
    """The call ``Name(...)`` at token ``i``, and the token after its closing parenthesis."""
    name, depth, end = tokens[i][1], 0, i + 1
    while end < len(tokens):
        depth += {"(": 1, ")": -1}.get(tokens[end][1], 0)
        if depth == 0:
            break
        end += 1
    if end == len(tokens):
        raise ValueError(f"unreadable grammar: {name}( is not closed")
    if name in _TERMINAL_CALLS:
        return _TEXT, end + 1
    if name in _DISPATCH_CALLS:  # its (tag, rule) pairs: the rule is the name before a ")"
        targets = tuple(Node("ref", name=tokens[k][1]) for k in range(i + 2, end)
                        if tokens[k][0] == "name" and tokens[k + 1][1] == ")")
        return Node("dispatch", parts=targets), end + 1
    raise ValueError(f"unreadable grammar: unknown construct {name}(...)")
