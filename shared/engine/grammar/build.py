"""A GrammarSpec as xgrammar's Grammar and CompiledGrammar, xgrammar's errors as ValueErrors
naming the problem: what a compile worker runs (``compile_worker``) and the cheap parse that
``GrammarCompiler.validate`` runs in the caller."""

from __future__ import annotations

import re

import xgrammar as xgr

from shared.engine.grammar.response_format import GrammarSpec
from shared.engine.grammar.termination import check_rules_finish

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes a check text.
_XGR_ERROR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def compile_spec(compiler: xgr.GrammarCompiler, spec: GrammarSpec) -> xgr.CompiledGrammar:
    """``spec`` parsed and compiled by ``compiler``; ValueError naming the problem."""
    grammar = parse_grammar(spec)
    try:
        return compiler.compile_grammar(grammar)
    except RuntimeError as exc:
        raise ValueError(f"cannot compile {spec.kind.replace('_', ' ')}: {_xgr_reason(exc)}") from exc


def parse_grammar(spec: GrammarSpec) -> xgr.Grammar:
    """The xgrammar Grammar of `spec` (no token masks yet); ValueError naming the problem,
    including a rule that can never finish (``termination``)."""
    grammar = _xgr_grammar(spec)
    try:
        check_rules_finish(str(grammar))
    except ValueError as exc:
        raise ValueError(f"invalid {spec.kind.replace('_', ' ')}: {exc}") from exc
    return grammar


def _xgr_grammar(spec: GrammarSpec) -> xgr.Grammar:
    try:
        if spec.kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec.source, any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":
            # NOTE: not builtin_json_grammar(), whose root also allows a top-level array.
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.source)
        return xgr.Grammar.from_ebnf(spec.source, root_rule_name="root")
    except RuntimeError as exc:
        raise ValueError(f"invalid {spec.kind.replace('_', ' ')}: {_xgr_reason(exc)}") from exc


def _xgr_reason(exc: RuntimeError) -> str:
    return _XGR_ERROR_PREFIX.sub("", str(exc).strip())
