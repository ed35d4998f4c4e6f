"""Static cost bounds of an EBNF grammar, read from its text before xgrammar parses it.

xgrammar matches EBNF with an Earley parser: every way the output so far can be split among
the rules stays alive in its state, and each step's mask fill and accept walks all of them.
Two shapes make that set grow with the output, and are refused here (``EbnfShape.check``):

- **Counted repetitions**: ``x{m,n}`` copies ``x`` n times; nested ones multiply, through
  groups and through rule references (``r ::= q{0,30}`` with ``q ::= ("a"){0,30}`` is 900
  copies). Refused past ``MAX_REPETITION`` copies along any path, as a regex is
  (``limits.repetition_product``). A recursive reference counts 1 (a loop, not a copy).
  A counted repetition of something that holds one is refused past the much lower nested
  bound (``limits.MAX_NESTED_REPETITION``): each split of the text among the inner copies is
  compiled, in time that grows with the square of their product.
- **Adjacent recursion**: two references to rules recursive with the rule holding them, one
  directly after the other in a sequence (``s ::= s s | "a"``, ``s ::= "a" s s | ""``). The
  boundary between them can fall anywhere, so the ways to parse n tokens grow as the Catalan
  numbers: a 361-byte grammar of this shape took 2-3 s per step. Recursion with something
  between the references (JSON's ``value ("," value)*``, ``"(" s ")"``) or one reference per
  sequence (``s ::= "a" s | ""``) costs a constant per token and passes.

Ambiguity in general cannot be decided from the text (``s ::= s "+" s | "a"`` is ambiguous
with a terminal between); what passes here is bounded at run time by the per-request work
budget (``shared.engine.request_budget``).

The grammar's rule count is bounded by ``MAX_EBNF_RULES``, so the reachability computed here
is cheap. Syntax errors are left to xgrammar's parser: this scan only reads what it recognizes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_EBNF_RULES = 1_024
_TOKEN = re.compile(r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<rule>[A-Za-z_][\w.-]*)\s*::=
  | (?P<ref>[A-Za-z_][\w.-]*)
  | (?P<literal>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|\[(?:\\.|[^\]\\])*\])
  | (?P<counted>\{\s*(?P<low>\d+)\s*(?:,\s*(?P<high>\d*)\s*)?\})
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)


@dataclass(frozen=True)
class Token:
    kind: str  # "rule" (a rule's head), "ref", "literal", "counted", "other" (one character)
    text: str
    copies: int = 1  # of a counted repetition: its upper bound ({m,} counts m)


@dataclass
class EbnfShape:
    """An EBNF text as rule bodies of tokens: the structure the bounds need, nothing more."""

    rules: dict[str, list[Token]]

    @classmethod
    def of(cls, text: str) -> "EbnfShape":
        """The rules of ``text``; ValueError past ``MAX_EBNF_RULES`` rules."""
        rules: dict[str, list[Token]] = {}
        body: list[Token] = []
        for m in _TOKEN.finditer(text):
            kind = m.lastgroup
            if kind == "space":
                continue
            if kind == "rule":
                body = rules.setdefault(m.group("rule"), [])
                if len(rules) > MAX_EBNF_RULES:
                    raise ValueError(f"response_format.ebnf: more than {MAX_EBNF_RULES} rules")
            elif kind == "counted":
                low, high = m.group("low"), m.group("high")
                body.append(Token("counted", m.group(0), int(high) if high else int(low)))
            else:
                body.append(Token(kind, m.group(0)))
        return cls(rules)

    def check(self, max_repetition: int, max_nested_repetition: int) -> None:
        """ValueError naming the first bound the grammar exceeds (see the module's docstring)."""
        reach = {name: self._reachable(name) for name in self.rules}
        for name, body in self.rules.items():
            recursive = {r for r in reach[name] if name in reach.get(r, ())}
            if pair := _adjacent(body, recursive):
                raise ValueError(f"response_format.ebnf: rule {name!r} puts the recursive rules {pair[0]!r} "
                                 f"and {pair[1]!r} side by side: the split between them is ambiguous and "
                                 "each step's work would grow with the output")
        products: dict[str, int] = {}
        nested: dict[str, int] = {}
        for name in self.rules:
            if (copies := self._product(name, products, nested)) > max_repetition:
                raise ValueError(f"response_format.ebnf: nested counted repetitions make {copies} copies in "
                                 f"rule {name!r}, more than {max_repetition}")
        for name, copies in nested.items():
            if copies > max_nested_repetition:
                raise ValueError(f"response_format.ebnf: a counted repetition of a counted repetition makes "
                                 f"{copies} copies in rule {name!r}, more than {max_nested_repetition}")

    def _reachable(self, name: str) -> set[str]:
        """The rules ``name`` references, directly or through others."""
        seen: set[str] = set()
        stack = [name]
        while stack:
            for token in self.rules.get(stack.pop(), ()):
                if token.kind == "ref" and token.text not in seen:
                    seen.add(token.text)
                    stack.append(token.text)
        return seen

    def _product(self, name: str, products: dict[str, int], nested: dict[str, int]) -> int:
        """The largest product of counted bounds along any path from rule ``name`` down
        (memoized in ``products``; a rule being computed, i.e. recursion, counts 1). Each rule
        whose body repeats something that holds a counted repetition gets the largest such
        product in ``nested``."""
        if name in products:
            return products[name]
        products[name] = 1
        inside = [1]  # per open group (and the whole body): the largest product within it
        last = 1  # the product of the element just read, for a repetition that follows it
        for token in self.rules.get(name, ()):
            last_before, last = last, 1
            if token.kind == "ref":
                last = self._product(token.text, products, nested) if token.text in self.rules else 1
                inside[-1] = max(inside[-1], last)
            elif token.text == "(":
                inside.append(1)
            elif token.text == ")" and len(inside) > 1:
                last = inside.pop()
                inside[-1] = max(inside[-1], last)
            elif token.kind == "counted":
                last = last_before * token.copies
                inside[-1] = max(inside[-1], last)
                if last_before > 1:
                    nested[name] = max(nested.get(name, 1), last)
        products[name] = max(inside)
        return products[name]


def _adjacent(body: list[Token], recursive: set[str]) -> tuple[str, str] | None:
    """The first two references to ``recursive`` rules that follow each other in ``body``
    (a postfix ``?``/``*``/``+`` on the first still counts as adjacent), else None."""
    previous: str | None = None
    for token in body:
        if token.kind == "ref":
            if previous is not None and token.text in recursive:
                return previous, token.text
            previous = token.text if token.text in recursive else None
        elif not (token.kind == "other" and token.text in "?*+"):
            previous = None
    return None
