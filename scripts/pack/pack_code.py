#!/usr/bin/env python3
"""Pack a training script into a self-extracting file, so fewer code bytes count toward the cap.

    python3 scripts/pack/pack_code.py [SRC] [-o OUT] [--check PACKED] [--table] [--for VAR=VALUE ... [--readable]]

--for PRESET=NAME [VAR=VALUE ...] specialises SRC to that run first (scripts/pack/specialise.py: only the code the run
executes; a submission's file, docs/submitting.md); with --readable the specialised source is written unminified.

SRC (default train_gpt.py) is minified (comments, docstrings, blank lines and function-signature annotations
removed, except the `constexpr` ones Triton reads from its kernels' signatures; one space per indentation level,
bracketed continuation lines joined, function-local variables renamed to short names), compressed with ZPAQ and
written 7 bits a byte as a string literal inside a wrapper: an import of zpaq (without it the file stops with one
line: the import's error and `pip install zpaq`) and of linecache; the decoded source registered in linecache
under the pseudo filename SOURCE_NAME, compiled with that name and exec'd (so inspect.getsource, through which
Triton's jit reads its kernels, finds their text). Without -o only the sizes are printed; --table prints them for
each packing step. --check PACKED verifies that PACKED is the packed form of SRC (compares the decoded payload
with minify(SRC); nothing is executed) and exits 1 if not.

Minification is done by text edits located with the standard library's ast and tokenize, never by
ast.unparse, and is verified: the minified source must parse to the same AST as SRC with its docstrings and
signature annotations (but the `constexpr` ones) removed and the renaming plan applied, and compile to the same
instructions on the same globals, attributes and constants as the unrenamed text. String literals (f-strings
included) are copied byte for byte. The renaming plan is derived from SRC alone (rename_plan), so --check
re-derives it.
"""
from __future__ import annotations

import argparse
import ast
import base64
import contextlib
import dis
import importlib
import io
import itertools
import keyword
import lzma
import math
import os
import re
import sys
import tempfile
import tokenize
import types
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # specialise.py, beside this file, wherever this is imported from
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import specialise  # noqa: E402

# The oldest Python the packed file must run on; the wrapper and the payload are both checked against it.
MIN_PYTHON = (3, 10)

# The payload is ZPAQ (one thread: deterministic) of the minified source: PyPI's zpaq, which COMPRESSOR=pergroup
# uses too. ZPAQ_METHOD is level 5's model for text ("5": orders 1-6, 8, 11, 15, a match model, sparse contexts and
# mixers) with two word models instead of its one: letters folded to upper case, and runs of lower case and "_" (the
# identifiers), and 4 MiB blocks ("x2") instead of the level's 64 MiB, whose larger tables decoded 3 times slower;
# 0.9% smaller than "5" on train_gpt.py (`--table`). A ZPAQ stream carries its own model, so any ZPAQ decoder reads
# it; the file decodes in about 0.4 s.
ZPAQ_METHOD = ("x2,0w1,65,26,223,20,0i1,1w1,95,32,255,20,0i1c256ci1,1,1,1,1,1,2,3,4ac0,2,0,255i1c0,3,0,0,255i1"
               "c0,4,0,0,0,255i1mm16ts19t0")
ZPAQ_LEVEL = 5  # the previous format's, for `--table`
# zpaq 0.3.7 publishes wheels for glibc 2.34 or newer only (manylinux_2_34); elsewhere pip builds it from source.
ZPAQ_GLIBC = "zpaq's wheels need glibc 2.34 or newer; on older Linux pip builds it from source with a C++ compiler"
BROTLI_QUALITY, BROTLI_LGWIN = 11, 24  # for `--table`

# ... written 7 bits a byte in a string literal (a valid UTF-8 file, as the counted size requires: SPEC-FRONTIER
# 13). The compressed bytes, as one big-endian bit string with PAD zero bits appended (PAD = -8N mod 7), are cut
# into 7-bit chunks; a chunk is written as the ASCII character with that code unless the code is one of ESCAPED
# (NUL, CR, SO, SI, ESC, quote, backslash: Python's literal cannot hold the first and the last two verbatim, the
# others garble a terminal that shows the file); such a chunk and the one after it (0 past the end) are written
# as the two-byte character U+00A0 + 128 * (its index in ESCAPED) + (next chunk), which lies in U+00A0..U+041F
# (Latin, IPA, Greek, Cyrillic: no control or bidirectional character). So every byte of the literal carries
# 7 bits (1.143 characters a byte; base 116 took 1.167, Base85 1.25). The wrapper turns each character back
# into 7 or 14 bits, drops the SHIFT trailing bits (PAD, plus 7 when the last chunk was escaped) and takes the
# N bytes. VT FF FS GS RS may appear: line breaks for str.splitlines only, not for Python or `wc -l`.
# The wrapper's import of zpaq, when it fails (zpaq not installed, or its binary not loading: zpaq 0.3.7 publishes
# wheels for glibc 2.34 or newer only), ends the run with one line, the import's error and the fix, instead of a
# traceback: SystemExit prints its message on stderr and exits 1.
# Then the decoded source s (str) is put in linecache's cache as the file SOURCE_NAME (mtime None: linecache's
# checkcache never drops such an entry), compiled under that name and exec'd in the wrapper's own globals (so
# `__name__` and `__file__` are the packed file's, as when it exec'd the bytes). Triton's jit reads a kernel's text
# through inspect.getsourcelines, which finds it there by the code's co_filename: without it (exec of a string:
# "<string>", no text) a GPU run could not jit the fused kernels at all and the interpreter ran them unrewritten.
# Triton reads the text once, when a kernel is jitted (a JITFunction keeps it; the interpreter rewrites a kernel on
# its first run); tracebacks show the payload's lines too. Lines as str.splitlines(keepends) cuts them (as CPython's
# own registration of interactive code does); pack refuses a payload where that differs from Python's line count
# (pack_minified). Neither a file written next to the script nor an import: the record folder gets nothing, any
# working folder does, and the program still runs as __main__. One packed program per process: a second one's
# source would replace the first's under the same name (Triton would read the second's text for the first's kernels).
ESCAPED = b"\0\r\16\17\33\"\\"
TWO_BYTE_START = 0xA0
SOURCE_NAME = "<packed>"
WRAPPER_HEAD = ("try:import zpaq as Z,linecache as L\nexcept ImportError as e:raise SystemExit(f\"{e}: pip install"
                " zpaq\")\n"
                "s=Z.decompress((int(\"\".join(format(c,\"07b\")if c<128 else format(b\"\\0\\r\\16"
                "\\17\\33\\\"\\\\\"[c-160>>7]*128+(c-160&127),\"014b\")for c in map(ord,\"\"\"")
WRAPPER_TAIL = ("\"\"\")),2)>>{shift}).to_bytes({n},\"big\")).decode()\n"
                "f=\"" + SOURCE_NAME + "\";L.cache[f]=0,None,s.splitlines(1),f;exec(compile(s,f,\"exec\"))\n")
_TAIL_PATTERN = re.compile(r'"""\)\),2\)>>([0-9]+)\)\.to_bytes\(([1-9][0-9]*),"big"\)\)\.decode\(\)\n'
                           + re.escape(WRAPPER_TAIL.split("\n")[1] + "\n") + r'\Z')

# Files in an older format are refused with one line: LZMA2 + Base85 (before local renaming and ZPAQ), ZPAQ level
# 5 in base 116 (before ZPAQ_METHOD and the 7-bit literal), the 7-bit literal before its one-line zpaq error, and
# the wrapper that exec'd the bytes as they came (no source for Triton: the fused kernels fell back to eager).
LEGACY_HEADS = {
    "import lzma as L,base64 as B\nexec(L.decompress(B.b85decode(\"": "LZMA2 + Base85, locals not renamed",
    "import zpaq as Z\nexec(Z.decompress((lambda s:b\"\".join(": "ZPAQ level 5 in base 116",
    "import zpaq as Z\nexec(Z.decompress((int(": "the 7-bit literal without the one-line error for a missing zpaq",
    "try:import zpaq as Z\nexcept ImportError as e:raise SystemExit(f\"{e}: pip install zpaq\")\nexec(Z.decompress(("
    "int(": "the wrapper that gave Triton no source to read: the fused kernels ran eager",
}

# Raw LZMA2, the format before ZPAQ, kept for `--table`: preset 9 extreme with pb=0 and an 8 MiB dictionary.
LZMA_FILTER = {"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "dict_size": 1 << 23, "lc": 3, "lp": 0,
               "pb": 0}

_FSTRING_START = getattr(tokenize, "FSTRING_START", None)  # Python 3.12+ splits f-strings into tokens
_FSTRING_END = getattr(tokenize, "FSTRING_END", None)
_SKIPPED = (tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER)
_WORD = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


class PackError(ValueError):
    """A source that cannot be minified or packed, or a file that is not a packed one (one-line message)."""


# ---------------------------------------------------------------------------
# Minify


def _is_docstring(stmt: ast.stmt) -> bool:
    """A statement that is a bare string constant (a docstring or any other string expression statement)."""
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


# The nodes whose fields may hold statements (ast's grammar: no expression, argument or keyword does)
_STATEMENT_HOLDERS = (ast.stmt, ast.mod, ast.excepthandler, getattr(ast, "match_case", ast.stmt))

# ast.iter_child_nodes without the shared context and operator nodes (Load, Add, ...), which nothing here looks for:
# specialise.py's walk, one for both
_children = specialise.child_nodes


def _walk(tree: ast.AST, kids: dict | None = None) -> list[ast.AST]:
    """The nodes of ``tree`` in ast.walk's order (breadth first) but for the context and operator nodes (_children);
    each one's _children put in ``kids``, if given (for the walks after this one)."""
    nodes, i = [tree], 0
    if kids is None:
        while i < len(nodes):
            nodes.extend(_children(nodes[i]))
            i += 1
        return nodes
    while i < len(nodes):
        node = nodes[i]
        kids[node] = children = _children(node)
        nodes.extend(children)
        i += 1
    return nodes


def _statement_lists(tree: ast.AST, nodes: list[ast.AST] | None = None):
    """(node, field name, list of statements) for every statement list in the tree (``nodes``: _walk(tree), if
    made already)."""
    for node in _walk(tree) if nodes is None else nodes:
        if not isinstance(node, _STATEMENT_HOLDERS):
            continue
        for name, value in ast.iter_fields(node):
            if isinstance(value, list) and value and all(isinstance(v, ast.stmt) for v in value):
                yield node, name, value


def _signature_args(fn: ast.AST) -> list[ast.arg]:
    a = fn.args
    return [*a.posonlyargs, *a.args, *([a.vararg] if a.vararg else []), *a.kwonlyargs,
            *([a.kwarg] if a.kwarg else [])]


def _functions(tree: ast.AST, nodes: list[ast.AST] | None = None):
    """The function definitions in ``tree``, in ast.walk's order (``nodes``: _walk(tree), if made already)."""
    return [n for n in (_walk(tree) if nodes is None else nodes)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def keeps_annotation(arg: ast.arg) -> bool:
    """Whether minify keeps ``arg``'s annotation: one that names Triton's constexpr (`tl.constexpr`, `constexpr`,
    or a string annotation holding the word, as Triton tests it). Triton reads a kernel's signature when it jits it:
    a parameter so marked is a compile-time constant (tl.arange's bounds, BLOCK_M=64 passed at launch), and without
    the mark the launch fails. Every other signature annotation goes (train_gpt.py reads none: its custom ops
    spell out their schema)."""
    return arg.annotation is not None and any(
        (isinstance(n, ast.Name) and n.id == "constexpr") or (isinstance(n, ast.Attribute) and n.attr == "constexpr")
        or (isinstance(n, ast.Constant) and isinstance(n.value, str) and "constexpr" in n.value)
        for n in ast.walk(arg.annotation))


def strip_reference(tree: ast.Module, lists=None, functions=None) -> ast.Module:
    """The AST that minify's output must parse to: bare string statements removed (a body left empty gets
    one `pass`) and argument/return annotations of functions removed, but the argument annotations that
    keeps_annotation keeps. Modifies and returns ``tree``. (``lists``, ``functions``: its _statement_lists and
    _functions, if made already.)"""
    for node, name, stmts in list(_statement_lists(tree)) if lists is None else lists:
        kept = [s for s in stmts if not _is_docstring(s)]
        if not kept and not isinstance(node, ast.Module):
            kept = [ast.Pass()]
        setattr(node, name, kept)
    for fn in _functions(tree) if functions is None else functions:
        fn.returns = None
        for arg in _signature_args(fn):
            if not keeps_annotation(arg):
                arg.annotation = None
    return tree


class _Source:
    """Token list of a source plus conversions between ast positions and token positions."""

    def __init__(self, src: str):
        self.src = src
        self.lines = io.StringIO(src).readlines()  # split at "\n" only, as tokenize and ast count lines
        self.line_starts = [0]
        for line in self.lines:
            self.line_starts.append(self.line_starts[-1] + len(line))
        self.tokens = list(tokenize.generate_tokens(io.StringIO(src).readline))
        layout = _SKIPPED + (tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE)  # DEDENT shares the next token's start
        self.index = {t.start: i for i, t in enumerate(self.tokens) if t.type not in layout}

    def char_pos(self, lineno: int, byte_col: int) -> tuple[int, int]:
        """ast gives columns in UTF-8 bytes; tokenize in characters."""
        line = self.lines[lineno - 1] if lineno <= len(self.lines) else ""
        return lineno, len(line.encode("utf-8")[:byte_col].decode("utf-8", errors="replace"))

    def offset(self, pos: tuple[int, int]) -> int:
        return self.line_starts[pos[0] - 1] + pos[1]

    def token_at(self, lineno: int, byte_col: int) -> int:
        pos = self.char_pos(lineno, byte_col)
        if pos not in self.index:
            raise PackError(f"no token starts at line {pos[0]} column {pos[1]}")
        return self.index[pos]

    def next_significant(self, i: int, step: int = 1) -> int | None:
        i += step
        while 0 <= i < len(self.tokens):
            if self.tokens[i].type not in _SKIPPED:
                return i
            i += step
        return None

    def span_until(self, first: int, stops: tuple[str, ...]) -> set[int]:
        """Token indexes from ``first`` up to (not including) the first OP in ``stops`` at bracket depth 0."""
        depth, out, i = 0, set(), first
        while i < len(self.tokens):
            tok = self.tokens[i]
            if tok.type == tokenize.OP:
                if depth == 0 and tok.string in stops and i != first:
                    return out
                if tok.string in "([{":
                    depth += 1
                elif tok.string in ")]}":
                    depth -= 1
            out.add(i)
            i += 1
        raise PackError(f"unterminated annotation at line {self.tokens[first].start[0]}")


def _edits(source: _Source, tree: ast.Module, lists=None, functions=None) -> tuple[set[int], dict[int, str]]:
    """Token indexes to drop and tokens to replace (by index) for docstrings and signature annotations (but those
    keeps_annotation keeps). (``lists``, ``functions``: the tree's _statement_lists and _functions, if made.)"""
    drop: set[int] = set()
    replace: dict[int, str] = {}
    for node, _name, stmts in _statement_lists(tree) if lists is None else lists:
        strings = [s for s in stmts if _is_docstring(s)]
        empty = len(strings) == len(stmts) and not isinstance(node, ast.Module)
        for k, stmt in enumerate(strings):
            first = source.token_at(stmt.lineno, stmt.col_offset)
            end = source.char_pos(stmt.end_lineno, stmt.end_col_offset)
            span, i = set(), first
            while i < len(source.tokens) and source.tokens[i].start < end:
                if source.tokens[i].type not in _SKIPPED:
                    span.add(i)
                i += 1
            drop |= span
            if empty and k == 0:  # the body would be left empty: the first string becomes `pass`
                drop.discard(first)
                replace[first] = "pass"  # emitted as a NAME (see _emit_lines)
                continue
            after = source.next_significant(max(span))
            before = source.next_significant(first, -1)
            while before is not None and before in drop:  # "a"; "b": look past the strings already dropped
                before = source.next_significant(before, -1)
            if after is not None and source.tokens[after].string == ";":
                drop.add(after)
            elif before is not None and source.tokens[before].string == ";":
                drop.add(before)
    for fn in _functions(tree) if functions is None else functions:
        for arg in _signature_args(fn):
            if arg.annotation is not None and not keeps_annotation(arg):
                colon = source.next_significant(source.token_at(arg.lineno, arg.col_offset))
                if source.tokens[colon].string != ":":
                    raise PackError(f"line {arg.lineno}: expected ':' after argument {arg.arg!r}")
                drop |= source.span_until(colon, (",", "=", ")"))
        if fn.returns is not None:
            i = source.token_at(fn.returns.lineno, fn.returns.col_offset)
            while i is not None and source.tokens[i].string != "->":
                i = source.next_significant(i, -1)
            if i is None:
                raise PackError(f"line {fn.lineno}: no '->' before the return annotation of {fn.name!r}")
            drop |= source.span_until(i, (":",))
    return drop, replace


# ---------------------------------------------------------------------------
# Rename function-local names

# A function that calls one of these may read its locals by name: none of its names are renamed.
_DYNAMIC = frozenset({"locals", "vars", "eval", "exec", "dir"})
_NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_RESERVED = frozenset(keyword.kwlist) | {"_", "case", "match", "type"}  # never new names (soft keywords: any Python)
# _function_scope's and visible's classes, as sets of leaf classes (type tests)
_SCOPE_ENDS = frozenset((*_NESTED, ast.JoinedStr))
_COMPREHENSION_KINDS = frozenset(_COMPREHENSIONS)
_DECLARATIONS = frozenset((ast.Global, ast.Nonlocal, ast.Import, ast.ImportFrom, ast.MatchAs, ast.MatchStar,
                           ast.MatchMapping))
_NAMING = frozenset((ast.arg, ast.alias, ast.ClassDef, ast.Global, ast.Nonlocal, ast.ExceptHandler, ast.MatchAs,
                     ast.MatchStar, ast.MatchMapping))  # the others' _own_identifiers: a Name's id, a def's name, none


def _own_identifiers(n: ast.AST) -> set[str]:
    """The identifiers ``n`` itself (not its children) can name a variable with: a name, an argument, an
    import, a def/class name, global/nonlocal declarations, except-as and match captures."""
    if isinstance(n, ast.Name):
        return {n.id}
    if isinstance(n, ast.arg):
        return {n.arg}
    if isinstance(n, ast.alias):
        return {(n.asname or n.name).split(".")[0]}
    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {n.name}
    if isinstance(n, (ast.Global, ast.Nonlocal)):
        return set(n.names)
    if isinstance(n, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and n.name:
        return {n.name}
    if isinstance(n, ast.MatchMapping) and n.rest:
        return {n.rest}
    return set()


def _short_names():
    """a, b, ..., z, A, ..., Z, aa, ab, ...: the names given to renamed locals, in this order."""
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    for size in range(1, 4):
        for combo in itertools.product(letters, repeat=size):
            yield "".join(combo)


def _function_scope(fn: ast.AST, visible, kids: dict | None = None) -> tuple[list[ast.AST], set[str]]:
    """The Name and ExceptHandler nodes of ``fn``'s own scope (comprehensions included: their free names are
    ``fn``'s), and the names that must keep their spelling: parameters, global/nonlocal, imports, def/class
    names, match captures, comprehension targets, every name a nested function, lambda or class can see
    (closures: ``visible(node)``) and every name inside an f-string (its text is copied verbatim). ``kids``: the
    tree's _children by node (_walk), if made."""
    nodes: list[ast.AST] = []
    keep = {a.arg for a in _signature_args(fn)}
    stack = list(reversed(fn.body))
    while stack:
        node = stack.pop()
        kind = node.__class__  # a tree of ast.parse's: isinstance of a leaf class is `is`
        if kind is ast.Name:  # no child but its context
            nodes.append(node)
            continue
        if kind in _SCOPE_ENDS:
            keep |= visible(node)  # a nested def's decorators and defaults, evaluated here, are kept too
            continue
        if kind in _COMPREHENSION_KINDS:
            for gen in node.generators:
                keep |= visible(gen.target)
        elif kind in _DECLARATIONS:
            keep |= visible(node)
        elif kind is ast.ExceptHandler:
            nodes.append(node)
        stack.extend(reversed(_children(node) if kids is None else kids[node]))
    return nodes, keep


def rename_plan(tree: ast.Module) -> dict[tuple[int, int], dict[str, str]]:
    """For each function (by its (lineno, col_offset)), the renaming of its local variables to short names.

    Only names the function itself binds (assignment, for/with/except targets, walrus, del) and that nothing
    else can see: not parameters (a caller may pass them by keyword), not names a nested function, lambda or
    class can see (closures), not global/nonlocal ones, not names used in f-strings, and nothing at all in a
    function that calls locals/vars/eval/exec/dir. A new name is one that no identifier under the function
    uses, except the renamed names themselves and the renamed locals of nested functions (invisible here),
    so it shadows nothing the function can see. Derived from ``tree`` alone: deterministic, and idempotent
    (minifying minified code renames nothing more)."""
    plan: dict[tuple[int, int], dict[str, str]] = {}
    seen: dict[int, set[str]] = {}
    kids: dict[ast.AST, list[ast.AST]] = {}  # each node's _children, made by the first walk
    functions = _functions(tree, _walk(tree, kids))

    def visible(node: ast.AST) -> set[str]:
        """Identifiers under ``node`` that a scope around it must treat as used there."""
        out: set[str] = set()
        stack = [node]
        while stack:
            n = stack.pop()
            kind = n.__class__
            if kind is ast.Name:  # no child but its context
                out.add(n.id)
                continue
            if kind is ast.FunctionDef or kind is ast.AsyncFunctionDef:
                out |= function(n)
                continue
            if kind in _NAMING:
                out |= _own_identifiers(n)
            stack.extend(kids[n])
        return out

    def function(fn: ast.AST) -> set[str]:
        """Plans ``fn`` (once); what it shows its surroundings: its identifiers less its renamed locals."""
        if id(fn) in seen:
            return seen[id(fn)]
        identifiers = _own_identifiers(fn).union(*map(visible, kids[fn]))
        mapping: dict[str, str] = {}
        if not identifiers & _DYNAMIC:
            nodes, keep = _function_scope(fn, visible, kids)
            bound: list[str] = []
            for n in nodes:
                name = n.name if isinstance(n, ast.ExceptHandler) else None if isinstance(n.ctx, ast.Load) else n.id
                if name and name not in keep and not name.startswith("__") and name not in bound:
                    bound.append(name)
            taken = identifiers - set(bound)  # the renamed names may swap spellings among themselves
            fresh = (n for n in _short_names() if n not in taken and n not in _RESERVED)
            mapping = {name: next(fresh) for name in bound}
        if mapping:
            plan[(fn.lineno, fn.col_offset)] = mapping
        seen[id(fn)] = identifiers - set(mapping) - set(mapping.values())
        return seen[id(fn)]

    for fn in functions:
        function(fn)
    return plan


def _rename_targets(tree: ast.Module, plan: dict[tuple[int, int], dict[str, str]], functions=None, kids=None):
    """(node, new name) for every Name / ExceptHandler the plan renames (``functions``: _functions(tree), ``kids``:
    its _children by node, if made)."""
    for fn in _functions(tree) if functions is None else functions:
        mapping = plan.get((fn.lineno, fn.col_offset))
        if mapping:
            for n in _function_scope(fn, lambda node: set(), kids)[0]:
                old = n.name if isinstance(n, ast.ExceptHandler) else n.id
                if old in mapping:
                    yield n, mapping[old]


def apply_rename(tree: ast.Module, plan: dict[tuple[int, int], dict[str, str]], targets=None) -> ast.Module:
    """``tree`` with the plan's renames made on the nodes (the AST minify's renamed output must parse to).
    ``targets``: _rename_targets' list, if made (before strip_reference, which changes none of them)."""
    for node, new in list(_rename_targets(tree, plan)) if targets is None else targets:
        if isinstance(node, ast.ExceptHandler):
            node.name = new
        else:
            node.id = new
    return tree


def _rename_edits(source: _Source, tree: ast.Module, plan, targets=None) -> dict[int, str]:
    """Token index -> new spelling for the plan's renames (``targets``: _rename_targets' list, if made)."""
    replace: dict[int, str] = {}
    for node, new in _rename_targets(tree, plan) if targets is None else targets:
        if isinstance(node, ast.ExceptHandler):  # `except E as name:`: the NAME after `as`
            i = source.token_at(node.lineno, node.col_offset)
            while not (source.tokens[i].string == node.name and source.tokens[i - 1].string == "as"):
                i += 1
        else:
            i = source.token_at(node.lineno, node.col_offset)
        if source.tokens[i].type != tokenize.NAME or source.tokens[i].string != (
                node.name if isinstance(node, ast.ExceptHandler) else node.id):
            raise PackError(f"line {node.lineno}: cannot locate the name to rename")
        replace[i] = new
    return replace


_LOCAL_OPS = ("FAST", "DEREF", "CLOSURE", "CELL")
# Whether dis names a variable (the argument's entry of the locals, cells and free variables) for exactly the
# instructions whose name holds one of _LOCAL_OPS: then two code objects of the same bytes differ in what dis gives
# only by the entries of those tables (_same_bytes_renamed).
_NAMED_BY_LOCAL_OPS = ({op for op, name in enumerate(dis.opname) if any(k in name for k in _LOCAL_OPS)}
                       == set(dis.haslocal) | set(getattr(dis, "hasfree", ())))


def _variable_tables(code) -> list[tuple[str, ...]]:
    """The tables an instruction's argument picks a variable name from: locals, cells, free variables, and on Python
    3.11+ the one of all three (its argument's numbering)."""
    tables = [code.co_varnames, code.co_cellvars, code.co_freevars]
    entry = getattr(code, "_varname_from_oparg", None)
    if entry is not None:
        names = []
        for i in range(sum(map(len, tables))):
            try:
                names.append(entry(i))
            except IndexError:
                break
        tables.append(tuple(names))
    return tables


def _same_bytes_renamed(a, b, pairs: set[tuple[str, str]]) -> bool:
    """A sufficient condition for _same_code_but_local_names' instruction loop to pass, read without dis: the same
    bytecode, the same constants at the same places (code objects against code objects), the same cells and free
    variables, and the variable tables of ``a`` mapped onto ``b``'s entry by entry one to one, each pair the same
    name or one of ``pairs``. Then each instruction dis reads of ``b`` is that of ``a`` with the same operation, and
    an argument that differs is a variable (a local op's) renamed by that one-to-one map."""
    if (not _NAMED_BY_LOCAL_OPS or a.co_code != b.co_code or a.co_cellvars != b.co_cellvars
            or a.co_freevars != b.co_freevars or len(a.co_consts) != len(b.co_consts)):
        return False
    for x, y in zip(a.co_consts, b.co_consts):
        code = isinstance(x, types.CodeType)
        if code != isinstance(y, types.CodeType) or (not code and x != y):
            return False
    forward: dict[str, str] = {}
    backward: dict[str, str] = {}
    for ta, tb in zip(_variable_tables(a), _variable_tables(b)):
        if len(ta) != len(tb):
            return False
        for o, n in zip(ta, tb):
            if forward.setdefault(o, n) != n or backward.setdefault(n, o) != o or (o != n and (o, n) not in pairs):
                return False
    return True


def _same_code_but_local_names(a, b, pairs: set[tuple[str, str]]) -> bool:
    """Whether code objects ``a`` (not renamed) and ``b`` (renamed) run the same instructions on the same
    globals, attributes and constants, differing only in local/cell variable names, one to one, by ``pairs``:
    a rename that turned a local into a global (or back) or merged two variables would change them. Cells
    and closures are ordered by name, so MAKE_CELL and LOAD_CLOSURE (3.13: LOAD_FAST of a cell) are compared as a
    set."""
    if (a.co_names != b.co_names or a.co_argcount != b.co_argcount or a.co_flags != b.co_flags
            or a.co_kwonlyargcount != b.co_kwonlyargcount or a.co_nlocals != b.co_nlocals
            or a.co_varnames[:a.co_argcount + a.co_kwonlyargcount] != b.co_varnames[:b.co_argcount
                                                                                  + b.co_kwonlyargcount]):
        return False
    if not _same_bytes_renamed(a, b, pairs):  # dis's reading, instruction by instruction (slow): the general case
        ia, ib = list(dis.get_instructions(a)), list(dis.get_instructions(b))
        if len(ia) != len(ib):
            return False
        forward: dict[str, str] = {}
        backward: dict[str, str] = {}
        cells: tuple[set, set] = (set(), set())
        for x, y in zip(ia, ib):
            if x.opname != y.opname:
                return False
            if isinstance(x.argval, types.CodeType) and isinstance(y.argval, types.CodeType):
                continue  # compared through co_consts below
            if x.opname in ("MAKE_CELL", "LOAD_CLOSURE") or (x.opname == "LOAD_FAST" and x.argval in a.co_cellvars
                                                             and y.argval in b.co_cellvars):
                # Python 3.13 compiles LOAD_CLOSURE (building a closure's tuple, in name order) as LOAD_FAST of the cell
                cells[0].add(x.argval)
                cells[1].add(y.argval)
            elif any(op in x.opname for op in _LOCAL_OPS):
                olds = x.argval if isinstance(x.argval, tuple) else (x.argval,)
                news = y.argval if isinstance(y.argval, tuple) else (y.argval,)
                if len(olds) != len(news):
                    return False
                for o, n in zip(olds, news):
                    if (forward.setdefault(o, n) != n or backward.setdefault(n, o) != o
                            or (o != n and (o, n) not in pairs)):
                        return False
            elif x.argval != y.argval:
                return False
        if {forward.get(c, c) for c in cells[0]} != cells[1]:
            return False
    ca = [c for c in a.co_consts if isinstance(c, types.CodeType)]
    cb = [c for c in b.co_consts if isinstance(c, types.CodeType)]
    plain = [c for c in a.co_consts if not isinstance(c, types.CodeType)]
    return (plain == [c for c in b.co_consts if not isinstance(c, types.CodeType)] and len(ca) == len(cb)
            and all(_same_code_but_local_names(x, y, pairs) for x, y in zip(ca, cb)))


def _needs_space(prev: str, prev_type: int, nxt: str, nxt_type: int) -> bool:
    if not prev or not nxt:
        return False
    if prev[-1] in _WORD and nxt[0] in _WORD:
        return True
    # 1 .real, 1 if x else 2, x if y else .5: keep numbers apart from anything that could extend them.
    if prev_type == tokenize.NUMBER and (nxt[0] in _WORD or nxt[0] == "."):
        return True
    return nxt_type == tokenize.NUMBER and prev[-1] in _WORD | {"."}


def _emit_lines(source: _Source, drop: set[int], replace: dict[int, str]) -> list[str]:
    out: list[str] = []
    depth = 0
    parts: list[tuple[str, int]] = []
    tokens = source.tokens
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.type == tokenize.INDENT:
            depth += 1
        elif tok.type == tokenize.DEDENT:
            depth -= 1
        elif tok.type == tokenize.NEWLINE:
            if parts:
                text = parts[0][0]
                # A statement starting with the soft keyword match/case keeps its space (`match [x]:`):
                # harmless if it is a plain name, and no parser need guess.
                soft = parts[0][1] == tokenize.NAME and text in ("match", "case")
                for (p, pt), (n, nt) in zip(parts, parts[1:]):
                    text += (" " if soft or _needs_space(p, pt, n, nt) else "") + n
                    soft = False
                out.append(" " * depth + text + "\n")
            parts = []
        elif tok.type in _SKIPPED or i in drop:
            pass
        elif _FSTRING_START is not None and tok.type == _FSTRING_START:
            nest, j = 0, i
            while True:  # copy the whole f-string (nested ones included) from the source text
                if tokens[j].type == _FSTRING_START:
                    nest += 1
                elif tokens[j].type == _FSTRING_END:
                    nest -= 1
                    if nest == 0:
                        break
                j += 1
            parts.append((source.src[source.offset(tok.start):source.offset(tokens[j].end)], tokenize.STRING))
            i = j
        else:
            parts.append((replace[i], tokenize.NAME) if i in replace else (tok.string, tok.type))
        i += 1
    return out


def _dump(tree: ast.AST) -> str:
    return ast.dump(tree, include_attributes=False)


_PLAIN = (str, int, bytes, bool, type(None))  # values of these types with equal values have equal reprs


def _same_tree(a, b) -> bool:
    """A sufficient condition for _dump(a) == _dump(b), tested node by node without writing either: the same node
    classes, the same fields present, equal lists, and leaves of the same type with the same repr (equal values for
    _PLAIN types). False says nothing: the dumps decide."""
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if x is y:  # one object (a context or operator node): one dump
            continue
        kind = x.__class__
        if kind is not y.__class__:
            return False
        if isinstance(x, ast.AST):
            for name in x._fields:
                vx = getattr(x, name, stack)  # stack: absent (dump leaves the field out)
                vy = getattr(y, name, stack)
                if vx is stack or vy is stack:
                    if vx is not vy:
                        return False
                    continue
                stack.append((vx, vy))
        elif kind is list:
            if len(x) != len(y):
                return False
            stack.extend(zip(x, y))
        elif kind in _PLAIN:
            if x != y:
                return False
        elif repr(x) != repr(y):
            return False
    return True


# The cyclic garbage collector off while minify walks its trees (specialise.py's pause: an AST holds no cycle)
_gc_paused = specialise.gc_paused


def minify(src: str, rename: bool = True) -> str:
    """The same program in fewer bytes (see the module docstring); raises PackError if ``src`` does not parse
    or the result would not be the same program. ``rename=False`` keeps local names (for `--table`)."""
    with _gc_paused():
        return _minify(src, rename)


def _minify(src: str, rename: bool) -> str:
    try:
        tree = ast.parse(src)
    except SyntaxError as exc:
        raise PackError(f"does not parse: {exc.msg} (line {exc.lineno})") from None
    except ValueError as exc:  # null bytes
        raise PackError(f"does not parse: {exc}") from None
    try:
        source = _Source(src)
    except (tokenize.TokenError, SyntaxError) as exc:
        raise PackError(f"cannot tokenize: {exc}") from None
    kids: dict[ast.AST, list[ast.AST]] = {}
    nodes = _walk(tree, kids)  # walked once: its statement lists and functions are strip_reference's too (it removes
    # no statement list's owner and no function), its rename targets apply_rename's (no Name or handler of them goes)
    lists, functions = list(_statement_lists(tree, nodes)), _functions(tree, nodes)
    drop, replace = _edits(source, tree, lists, functions)
    plan = rename_plan(tree) if rename else {}
    targets = list(_rename_targets(tree, plan, functions, kids))
    renamed = {**replace, **_rename_edits(source, tree, plan, targets)}
    stripped = "".join(_emit_lines(source, drop, replace))
    result = "".join(_emit_lines(source, drop, renamed))
    expected = apply_rename(strip_reference(tree, lists, functions), plan, targets)
    try:
        got = ast.parse(result)
    except SyntaxError as exc:
        raise PackError(f"minified source does not parse: {exc.msg} (line {exc.lineno}); a minify bug") from None
    if not _same_tree(got, expected) and _dump(got) != _dump(expected):
        raise PackError("minified source is a different program (AST differs from the source's with docstrings"
                        " and signature annotations but constexpr ones removed and its locals renamed); a minify bug")
    pairs = {pair for mapping in plan.values() for pair in mapping.items()}
    if not _same_code_but_local_names(compile(stripped, "<minified>", "exec", dont_inherit=True),
                                      compile(result, "<minified>", "exec", dont_inherit=True), pairs):
        raise PackError("renaming locals changed the compiled code beyond local names; a minify bug")
    return result


# ---------------------------------------------------------------------------
# Pack / unpack


def _module(name: str):
    """zpaq or brotli, imported here: minify and the checks of the wrapper need neither. Not installed, or installed
    and failing to import: a PackError naming the package and the fix."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == name:
            raise PackError(f"packing needs the {name} package: pip install {name}") from None
        error = (str(exc).strip().splitlines() or [""])[0]
        note = f"; {ZPAQ_GLIBC}" if name == "zpaq" else ""
        raise PackError(f"packing needs the {name} package: pip install --force-reinstall {name} (it is installed, but"
                        f" its import fails: {type(exc).__name__}: {error}{note})") from None


def compress(data: bytes) -> bytes:
    return _module("zpaq").compress(data, threads=1, method=ZPAQ_METHOD)


def b7encode(data: bytes) -> tuple[str, int]:
    """(text, shift): ``data`` 7 bits a character (see ESCAPED); b7decode(text, len(data), shift) gives it back."""
    if not data:
        return "", 0
    pad = -8 * len(data) % 7
    bits = bin(int.from_bytes(data, "big"))[2:].zfill(8 * len(data)) + "0" * pad
    chunks = [int(bits[j:j + 7], 2) for j in range(0, len(bits), 7)]
    out, i, shift = [], 0, pad
    while i < len(chunks):
        if chunks[i] in ESCAPED:
            if i + 1 == len(chunks):
                chunks.append(0)
                shift += 7
            out.append(chr(TWO_BYTE_START + 128 * ESCAPED.index(chunks[i]) + chunks[i + 1]))
            i += 2
        else:
            out.append(chr(chunks[i]))
            i += 1
    return "".join(out), shift


def b7decode(text: str, n: int, shift: int) -> bytes:
    """The inverse of b7encode, as the wrapper computes it; PackError for a character b7encode never writes or
    a length that does not match ``n`` and ``shift``."""
    bits = []
    for ch in text:
        c = ord(ch)
        if c < 128 and c not in ESCAPED:
            bits.append(format(c, "07b"))
        elif 0 <= c - TWO_BYTE_START < 128 * len(ESCAPED):
            k = c - TWO_BYTE_START
            bits.append(format(ESCAPED[k >> 7] * 128 + (k & 127), "014b"))
        else:
            raise PackError(f"payload does not decode: it holds U+{c:04X}, which the 7-bit code never writes")
    if not 0 <= shift < 14 or sum(map(len, bits)) != 8 * n + shift:
        raise PackError(f"payload does not decode: it carries {sum(map(len, bits))} bits, not {n} bytes and"
                        f" {shift} padding bits")
    return (int("".join(bits) or "0", 2) >> shift).to_bytes(n, "big")


def _decode(payload: str, n: int, shift: int) -> str:
    """What the wrapper's exec receives, decoded as Python does (UTF-8)."""
    zpaq = _module("zpaq")
    try:
        return zpaq.decompress(b7decode(payload, n, shift)).decode("utf-8")
    except (zpaq.Error, UnicodeDecodeError) as exc:  # corrupt stream, not UTF-8
        raise PackError(f"payload does not decode: {exc}") from None


def _wrap(data: bytes, module: str = "zpaq") -> str:
    """The packed file around the compressed ``data`` (``module``: the decompressor the wrapper imports)."""
    payload, shift = b7encode(data)
    return (WRAPPER_HEAD.replace("zpaq", module, 1) + payload
            + WRAPPER_TAIL.format(shift=shift, n=len(data)))


# Where str.splitlines (the wrapper's lines for linecache) breaks a line and Python does not: VT, FF, FS, GS, RS,
# NEL, LS, PS (CR and CR LF: both; Python reads them as line ends too).
_ODD_LINE_BREAK = re.compile("[\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


def pack_minified(minified: str) -> str:
    """The packed file for an already minified source; checked to decode back to it."""
    try:
        ast.parse(minified, feature_version=MIN_PYTHON)
    except SyntaxError as exc:
        raise PackError(f"does not parse as Python {MIN_PYTHON[0]}.{MIN_PYTHON[1]}: {exc.msg}"
                        f" (line {exc.lineno})") from None
    odd = _ODD_LINE_BREAK.search(minified)
    if odd:
        line = minified.count("\n", 0, odd.start()) + 1
        raise PackError(f"line {line} holds U+{ord(odd[0]):04X}, where str.splitlines breaks a line and Python does"
                        " not: the wrapper's lines for inspect (Triton) would be off; write it as an escape")
    packed = _wrap(compress(minified.encode("utf-8")))
    ast.parse(packed, feature_version=MIN_PYTHON)
    if unpack(packed) != minified:
        raise PackError("packed file does not decode back to the minified source")
    return packed


def pack(src: str) -> str:
    """The self-extracting file: import zpaq, then exec the minified ``src`` from ZPAQ in a 7-bit literal."""
    if is_packed(src):
        raise PackError("already packed")
    with _gc_paused():
        return pack_minified(minify(src))


def _payload_literal(text: str) -> tuple[str, int, int]:
    """(payload, n, shift) of a packed file; PackError unless the file is exactly the wrapper around them."""
    for head, what in LEGACY_HEADS.items():
        if text.startswith(head):
            raise PackError(f"an older packed format ({what}): repack it from the readable source with this"
                            " scripts/pack/pack_code.py")
    tail = _TAIL_PATTERN.search(text)
    if not text.startswith(WRAPPER_HEAD) or tail is None or tail.start() < len(WRAPPER_HEAD):
        raise PackError("not a packed file: not the wrapper pack_code.py writes")
    payload, shift, n = text[len(WRAPPER_HEAD):tail.start()], int(tail[1]), int(tail[2])
    if text != WRAPPER_HEAD + payload + WRAPPER_TAIL.format(shift=shift, n=n) or '"' in payload or "\\" in payload:
        raise PackError("not a packed file: not the wrapper pack_code.py writes")
    return payload, n, shift


def unpack(packed_text: str) -> str:
    """The source a packed file executes, recovered without executing anything."""
    return _decode(*_payload_literal(packed_text))


def is_packed(text: str) -> bool:
    """True if ``text`` is the wrapper (whether or not its payload decodes), or one of the older formats."""
    if text.startswith(tuple(LEGACY_HEADS)):
        return True
    try:
        _payload_literal(text)
    except PackError:
        return False
    return True


# Any valid UTF-8 text without NUL, CR, quote and backslash (which a literal cannot hold verbatim) carries at most
# log2(x) bits a byte, x the root of 124/x + 1920/x**2 + 61440/x**3 + 1048576/x**4 = 1 (the numbers of such
# characters of 1, 2, 3 and 4 bytes): 7.140. So a compressed payload of C bytes needs at least 8C/7.140 bytes.
def _utf8_bits_per_byte() -> float:
    counts = (124, 1920, 61440, 1048576)
    lo, hi = 128.0, 256.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(c / mid ** (k + 1) for k, c in enumerate(counts)) > 1 else (lo, mid)
    return math.log2(lo)


def utf8_floor(compressed: int) -> int:
    """Fewest bytes any UTF-8 Python literal can hold ``compressed`` bytes in (wrapper not counted)."""
    return math.ceil(8 * compressed / _utf8_bits_per_byte())


def size_table(src: str) -> list[tuple[str, int, int, int]]:
    """(step, minified bytes, compressed bytes, packed bytes) for the packing steps one at a time: the oldest
    format (local names kept, raw LZMA2, Base85), then brotli, local renaming, the 7-bit literal, ZPAQ level 5
    and ZPAQ_METHOD in turn."""
    def b85_file(head: str, data: bytes, tail: str) -> int:
        return len(head) + len(base64.b85encode(data)) + len(tail)

    kept, renamed = (minify(src, rename=r).encode("utf-8") for r in (False, True))
    lz = lzma.compress(kept, format=lzma.FORMAT_RAW, filters=[LZMA_FILTER])
    legacy_head, legacy_tail = next(iter(LEGACY_HEADS)), "\"),format=L.FORMAT_RAW,filters=[{\"id\":L.FILTER_LZMA2}]))\n"
    head85, tail85 = "import brotli as B,base64 as A\nexec(B.decompress(A.b85decode(\"", "\")))\n"
    rows = [("locals kept, LZMA2, Base85 (the oldest format)", kept, lz, b85_file(legacy_head, lz, legacy_tail))]
    brotli, zpaq = _module("brotli"), _module("zpaq")
    for text in (kept, renamed):
        data = brotli.compress(text, quality=BROTLI_QUALITY, lgwin=BROTLI_LGWIN)
        step = f"locals {'renamed' if text is renamed else 'kept'}, brotli, Base85"
        rows.append((step, text, data, b85_file(head85, data, tail85)))
    for step, data, module in (
            ("locals renamed, brotli, 7-bit literal", data, "brotli"),
            ("locals renamed, ZPAQ level 5, 7-bit literal", zpaq.compress(renamed, ZPAQ_LEVEL, threads=1,
                                                                          hints=False), "zpaq"),
            ("locals renamed, ZPAQ_METHOD, 7-bit literal (this format)", compress(renamed), "zpaq")):
        rows.append((step, renamed, data, len(_wrap(data, module).encode("utf-8"))))
    return [(step, len(text), len(data), packed) for step, text, data, packed in rows]


# ---------------------------------------------------------------------------
# CLI


def _read_source(path: Path) -> str:
    if not path.is_file():
        raise PackError(f"{path}: no such file")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PackError(f"{path}: cannot read: {exc}") from None


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never a partial file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", nargs="?", default="train_gpt.py", type=Path, help="readable source (default: %(default)s)")
    p.add_argument("-o", "--output", type=Path, help="write the packed file here (atomically)")
    p.add_argument("--for", dest="run", nargs="+", metavar="VAR=VALUE",
                   help="specialise SRC to one run first (PRESET=NAME and settings; scripts/pack/specialise.py): "
                        "the file carries only that run's code")
    p.add_argument("--for-env", action="store_true",
                   help="specialise SRC to the run this environment describes (PRESET and the settings set in it; "
                        "not the machine's): what scripts/run/run_seeds.sh does with PACK_CODE=1")
    p.add_argument("--readable", action="store_true",
                   help="with --for: write the specialised source unminified, comments kept (the code the run executes)")
    p.add_argument("--check", type=Path, metavar="PACKED",
                   help="verify that PACKED is the packed form of SRC (nothing is executed); exit 1 if not")
    p.add_argument("--table", action="store_true",
                   help="print minified, compressed and packed bytes of SRC for each packing step")
    return p


def specialised_source(src: str, src_path: Path, run_items: list[str] | None, from_env: bool = False) -> str:
    """SRC specialised to the run given as VAR=VALUE items, or by the environment (scripts/pack/specialise.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))

    try:
        run = specialise.run_from_environ(src, os.environ) if from_env else specialise.parse_run(run_items)
        spec = specialise.specialise(src, run, str(src_path))
        print(f"specialised to {' '.join(f'{k}={v}' for k, v in spec.run.items())}: {len(src.splitlines())} -> "
              f"{len(spec.text.splitlines())} lines, {len(spec.conditions)} settings fixed", file=sys.stderr)
        return spec.text
    except specialise.SpecialiseError as exc:
        raise PackError(f"--for: {exc}") from None


def run(args: argparse.Namespace) -> int:
    src_path: Path = args.src
    out: Path | None = args.output
    src = _read_source(src_path)
    if out is not None:
        if out.exists() and out.resolve() == src_path.resolve():
            raise PackError(f"{out}: output is the source itself; write the packed file elsewhere")
        if not out.parent.is_dir():
            raise PackError(f"{out.parent}: no such directory")
    if is_packed(src):
        raise PackError(f"{src_path}: already packed; pass the readable source")
    if args.readable and not (args.run or args.for_env):
        raise PackError("--readable needs --for or --for-env (it writes the specialised source)")
    if args.run and args.for_env:
        raise PackError("give the run by --for or by --for-env, not both")
    if args.run or args.for_env:
        try:
            ast.parse(src)
        except SyntaxError as exc:
            raise PackError(f"{src_path}: does not parse: {exc.msg} (line {exc.lineno})") from None
        src = specialised_source(src, src_path, args.run, args.for_env)
        if args.readable:
            print(f"readable: {len(src.encode('utf-8'))} bytes, {len(src.splitlines())} lines (specialised)")
            if out is not None:
                write_atomic(out, src)
                print(f"wrote {out}")
            return 0
    try:
        minified = minify(src)
    except PackError as exc:
        raise PackError(f"{src_path}: {exc}") from None
    if args.table:
        print("| step | minified bytes | compressed bytes | packed bytes |\n|---|---:|---:|---:|")
        rows = size_table(src)
        for step, *sizes in rows:
            print(f"| {step} | " + " | ".join(f"{n:,}" for n in sizes) + " |")
        print(f"\nno UTF-8 literal holds the last row's {rows[-1][2]:,} compressed bytes in fewer than"
              f" {utf8_floor(rows[-1][2]):,} bytes ({_utf8_bits_per_byte():.3f} bits a byte at best; this format: 7)")
        return 0
    if args.check is not None:
        try:
            payload = unpack(_read_source(args.check))
        except PackError as exc:
            message = str(exc) if str(exc).startswith(f"{args.check}:") else f"{args.check}: {exc}"
            print(f"pack_code: FAIL: {message}", file=sys.stderr)
            return 1
        if payload != minified:
            print(f"pack_code: FAIL: {args.check}: its payload is not minify({src_path})", file=sys.stderr)
            return 1
        print(f"OK: {args.check} is the packed form of {src_path}")
        return 0
    try:
        packed = pack_minified(minified)
    except PackError as exc:
        raise PackError(f"{src_path}: {exc}") from None
    readable_n, minified_n, packed_n = (len(t.encode("utf-8")) for t in (src, minified, packed))
    print(f"readable: {readable_n} bytes")
    print(f"minified: {minified_n} bytes")
    print(f"packed:   {packed_n} bytes ({packed_n / readable_n:.1%} of readable)")
    if out is not None:
        write_atomic(out, packed)
        print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except PackError as exc:
        print(f"pack_code: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"pack_code: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
