#!/usr/bin/env python3
"""Specialise train_gpt.py to one run: the code that run executes, and nothing else (issue 60).

    python3 scripts/pack/specialise.py PRESET=record_0501 [VAR=VALUE ...] [--source train_gpt.py] [-o OUT]

(`scripts/pack/pack_code.py --for ...` packs the result; this script writes it readable: comments kept.)

What is removed comes from an analysis of the source, repeated until nothing changes:
- Settings. Every `self.X = self._env("NAME", default, kind)` of Hyperparameters is a setting. A *predicate* on one
  is a test of its value against a literal: `==`, `!=`, `in`, `not in`, `is (not) None` for any setting, `<`, `<=`,
  `>`, `>=` for an int one, or its truth value where a branch reads it (an if/while/conditional-expression test,
  `not`, an and/or inside one). Float settings (rates, seconds, fractions) and list ones are values: never tested
  here, but for a float setting whose run's value is 0 (a weight or a probability at 0: a technique off), known
  outright as 0.0 like a bool, its condition `== 0.0` (another value refused at start, in one line). MACHINE_SETTINGS (the source's own list: the world size, the device, compile, the attention kernel...) stay
  open. A predicate is folded to the constant it has for the run, and the condition is recorded: the specialised
  file refuses at start any value for which a recorded condition changes (SPECIALISED, Hyperparameters), so a
  folded branch is never silently wrong (SPECIALISED records each fixed setting's value, and the conditions of those
  not folded to it outright). A bool setting, one tested equal to a literal, or an int or str one whose truth is
  recorded false (0, "") is known outright: its every read becomes the literal. Predicates on an attribute that
  something other than Hyperparameters.__init__ assigns are not folded (its value at the test is not its value at
  start); in __init__ itself only those whose attribute is assigned once. A setting read into a local first
  (`prefix = self._env("PHASED_TTT_PREFIX_DOCS", ...)`) is the setting `<NAME>`: its predicates fold on the value
  read (Hyperparameters.effective, what the file's check compares).
- Constants. Conditions whose value is known fold (`not`, and/or, comparisons of literals, conditional
  expressions); a local assigned once at its function's top level to a literal, a parameter of a module function
  that every call in the file gives the same literal (its default where a call leaves it out; none when the
  function's name is read other than as a call) and that it never rebinds, a module global assigned once to
  one, and an attribute `self.a` that every assignment in the file (one class family, all through `self`) sets to
  the same literal (or to None, or always to a new object: `is None` is known; none of a family that a setattr with
  a computed name may write) are replaced by it; so are a module cell `NAME = [literal]` used only as NAME[0] with
  every store that literal, a parameter that every call gives the same read of a setting (it is that setting), an
  attribute stored once, from a read of a setting (`self.stop_at = h.eval_ttt_stop_at`: it is that setting), a
  Hyperparameters property that only returns a literal (or [], false in a condition), and, in conditions, a local
  whose truth is known though its value is not. A class's __init__ parameters count as a module function's, its
  constructions as the calls, while every construction is a call of its name (none through a subclass, cls(...),
  type(self)(...), or a type(x)(...) anywhere that may build it).
- What nothing declares. An attribute that nothing in the file binds (no store `x.a`, no module or class-body
  binding, def, class, import or call keyword of the name, no string of names naming it: setattr's, namedtuple's)
  and that no base type of Python's or torch's (Analysis.base_attribute) nor torch.nn class has is no module's:
  `getattr(m, "a", D)` is D and `hasattr(m, "a")` false for m a module of a walk (a comprehension's `for m in
  X.modules()` or `X.children()`): a piece's `reads`, `block_branch`, `term_weight` where the run has none. (A
  library's own objects, e.g. a module probed for a feature, are never m.)
  `tuple(generator)` of one that yields nothing (a `for` over a known empty literal, or an `if` known false, after
  only quiet iterations: a name, or its WALK_METHODS call such as self.modules()) is (); a `for` over () goes. A
  method's parameters count as a module function's, its calls being every `obj.NAME(...)` in the file (any object's:
  more to agree, never fewer), while every read of an attribute NAME is such a call, none goes through a class,
  no string names it and no base type has it (library code may call those); and `obj.NAME()` of a method that
  only returns a known literal, NAME bound nowhere else, is that literal (GPT.terms with no term piece).
- Statements. An `if`/`elif`/`while` whose test is known keeps only the branch taken (dedented); statements after a
  `return`/`raise`/`continue`/`break` in the same block go; a local that nothing reads any more and that was set to
  a literal goes, and so does `self.a = LITERAL` where nothing reads an attribute `a` and no string names it (a piece
  switched off: `self.piece = None`). A write-only object goes with the calls that set it: a global `NAME = Class()`
  read nowhere but in statements `NAME.method(...)` whose arguments call nothing and whose methods change only the
  object (CONTEXT where no piece of the run reads it). Runs of more than two blank lines left by the removals are cut
  to two.
- Definitions. Module-level functions, classes and assignments that no kept code names go (a root is any other
  module-level statement); a method or property goes when its name is read as an attribute nowhere and appears in
  no string (dunders and the hooks torch calls stay). A setting that nothing reads but Hyperparameters' own
  checks goes with its checks (a check that names it).
- Presets: PRESETS becomes the one preset of the run, the VAR=VALUE given merged into it (so they are the file's
  defaults), and PRESET's default its name.

The result is checked: it parses under Python 3.10 and compiles. Its equivalence with the full script (the same
loss and score lines, the same artifact bytes) is what tests/test_specialise.py runs.
"""
from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import gc
import hashlib
import itertools
import operator
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MIN_PYTHON = (3, 10)
# Methods torch (nn.Module, autograd.Function, torch.library) or Python call without naming them as an attribute.
HOOK_METHODS = frozenset(("forward", "backward", "setup_context", "extra_repr", "jvp", "vjp"))
# The comparison operators a predicate may use, as the specialised file evaluates them (SPECIALISED's conditions)
COMPARE_OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not",
               ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}
EQUALITY_OPS = ("==", "!=", "in", "not in", "is", "is not")
EVALUATE = {"==": operator.eq, "!=": operator.ne, "in": lambda a, b: a in b, "not in": lambda a, b: a not in b,
            "is": operator.is_, "is not": operator.is_not, "<": operator.lt, "<=": operator.le, ">": operator.gt,
            ">=": operator.ge, "truth": lambda a, b: bool(a)}
KEEP_NAMES = frozenset(("SPECIALISED", "PRESETS", "MACHINE_SETTINGS"))  # module names the specialisation writes or reads
UNKNOWN = object()  # a value the analysis does not know
NOT_NONE = object()  # an object that is not None (a new instance), whose value is otherwise unknown
_LITERAL_TYPES = (bool, int, float, str, type(None))
# Methods called with no arguments that only walk what they are called on (nn.Module's walks, a dict's views): an
# iteration over one changes nothing (_empty_iteration)
MODULE_WALKS = ("modules", "children")  # nn.Module's walks whose items are modules (Analysis._walked_module)
WALK_METHODS = frozenset(("modules", "children", "named_modules", "named_children", "parameters", "named_parameters",
                          "buffers", "named_buffers", "items", "keys", "values"))
# Node classes, tested as `node.__class__ is C` or `in` a set of them: a tree of ast.parse's has no node of a
# subclass, so for a leaf class C that is isinstance(node, C).
_NEW_OBJECTS = frozenset((ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp, ast.Lambda))  # NOT_NONE
# Expressions whose value no rule knows (no setting_of, predicate or _value case takes them: UNKNOWN, nothing
# recorded) and whose parts mark_hot meets on their own
_NEVER_KNOWN = frozenset((ast.BinOp, ast.Starred, ast.JoinedStr, ast.FormattedValue, ast.Slice, ast.Await, ast.Yield,
                          ast.YieldFrom, ast.GeneratorExp, ast.NamedExpr))
_STORE_STATEMENTS = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor, ast.Delete)  # _store_targets'
# The classes of the passes over all_nodes whose result depends on the order (Analysis.ordered): the attribute stores
# of _collect_constants and the functions of loads_anywhere_in.
_ORDERED_CLASSES = frozenset((*_STORE_STATEMENTS, ast.With, ast.Call, ast.ClassDef, ast.FunctionDef,
                              ast.AsyncFunctionDef, ast.Lambda))


class SpecialiseError(ValueError):
    """A run the source cannot be specialised to, or a result that fails its checks (one-line message)."""


@dataclass
class Specialised:
    text: str  # the specialised source, readable
    source_sha256: str
    run: dict  # the settings it was made for (PRESET and the VAR=VALUE given)
    conditions: dict = field(default_factory=dict)  # NAME -> [(op, literal, result)]
    rounds: int = 0


# ---------------------------------------------------------------------------------------------------- source text


class Source:
    """A source text and its AST, with offsets: node positions (lines, UTF-8 byte columns) to string indices."""

    def __init__(self, text):
        self.text = text
        self.tree = ast.parse(text)
        self.lines = text.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))
        self._string_lines = None
        self._nodes = None
        self._kids = None
        self._by_type = None
        self._owners = None

    @property
    def nodes(self):
        """Every node of the tree but the context and operator singletons (child_nodes), in ast.walk's order, walked
        once."""
        if self._nodes is None:
            kids, nodes, i = self._kids, [self.tree], 0
            if kids is None:
                kids = {}
                while i < len(nodes):  # breadth first, as ast.walk
                    node = nodes[i]
                    i += 1
                    kids[node] = children = child_nodes(node)
                    nodes.extend(children)
                self._kids = kids
            else:
                while i < len(nodes):
                    nodes.extend(kids[nodes[i]])
                    i += 1
            self._nodes = nodes
        return self._nodes

    @property
    def kids(self):
        """node -> its child nodes (child_nodes), for every node of `nodes`."""
        if self._kids is None:
            self.nodes
        return self._kids

    @property
    def by_type(self):
        """node class -> the nodes of `nodes` of that class, in the order of one walk (Analysis._index's where it made
        them): for a test of a few classes, which a pass over every node would make of each node."""
        if self._by_type is None:
            by_type = {}
            for node in self.nodes:
                by_type.setdefault(node.__class__, []).append(node)
            self._by_type = by_type
        return self._by_type

    def of_type(self, *classes):
        """The nodes of these (concrete, leaf) classes, class by class: for tests whose result no order changes."""
        by_type = self.by_type
        return [node for c in classes for node in by_type.get(c, ())]

    def walk(self, node):
        """The nodes under `node` (itself included) in ast.walk's order: a node of this tree."""
        kids, out, i = self.kids, [node], 0
        while i < len(out):
            out.extend(kids[out[i]])
            i += 1
        return out

    @property
    def owners(self):
        """id(statement) -> (the node whose statement list holds it, that list's field name)."""
        if self._owners is None:
            self._owners, todo = {}, [self.tree]
            while todo:  # statements only: expressions hold no statement lists
                node = todo.pop()
                for field_name in ("body", "orelse", "finalbody", "handlers"):
                    children = getattr(node, field_name, None)
                    for child in children if isinstance(children, list) else ():
                        self._owners[id(child)] = (node, field_name)
                        todo.append(child)
        return self._owners

    @property
    def string_lines(self):
        """Lines inside a multi-line string token (never re-indented)."""
        if self._string_lines is None:  # from the AST: a string constant (or f-string) over several lines; lines of
            # implicitly joined literals count too, which only keeps their indentation (they sit inside brackets)
            self._string_lines = set()
            for node in self.of_type(ast.Constant, ast.JoinedStr):
                if isinstance(node, (ast.Constant, ast.JoinedStr)) and node.end_lineno > node.lineno \
                        and (isinstance(node, ast.JoinedStr) or isinstance(node.value, (str, bytes))):
                    self._string_lines.update(range(node.lineno + 1, node.end_lineno + 1))
        return self._string_lines

    def offset(self, lineno, col):
        line = self.lines[lineno - 1]
        if line.isascii():  # a byte a character
            return self.starts[lineno - 1] + min(col, len(line))
        return self.starts[lineno - 1] + len(line.encode()[:col].decode())

    def span(self, node):
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def segment(self, node):
        a, b = self.span(node)
        return self.text[a:b]

    def indent(self, lineno):
        line = self.lines[lineno - 1]
        return len(line) - len(line.lstrip(" "))

    def dedented(self, first, last, by):
        """Lines first..last with `by` leading spaces removed (lines inside multi-line strings kept as they are)."""
        out = []
        for n in range(first, last + 1):
            line = self.lines[n - 1]
            if n not in self.string_lines and line.strip():
                cut = min(by, len(line) - len(line.lstrip(" ")))
                line = line[cut:]
            out.append(line)
        return "".join(out)

    def comments_above(self, lineno):
        """The first line of the comment lines directly above `lineno` at its indentation (or lineno)."""
        ind, n = self.indent(lineno), lineno
        while n > 1 and self.lines[n - 2].strip().startswith("#") and self.indent(n - 1) == ind \
                and (n - 1) not in self.string_lines:
            n -= 1
        return n


# The fields that hold only the shared, field-less nodes of a context (Load, Store, Del) or an operator (Add, And, Not,
# Eq, ...): one object each, under every Name, BinOp or Compare, that no analysis here looks at or below.
_SINGLETON_FIELDS = ("ctx", "op", "ops")
_NO_CHILDREN = ()  # a Name's or a Constant's (their other fields hold a str, a literal)
_CHILD_FIELDS = {}  # node class -> its other fields (child_nodes)


def child_nodes(node):
    """ast.iter_child_nodes(node) as a list (the same nodes in the same order) but for the context and operator
    singletons (_SINGLETON_FIELDS): a third of a tree's nodes, which every test here passes over."""
    fields = _CHILD_FIELDS.get(node.__class__)
    if fields is None:
        fields = _CHILD_FIELDS[node.__class__] = tuple(f for f in node._fields if f not in _SINGLETON_FIELDS)
    out = []
    for name in fields:
        value = getattr(node, name, None)
        if isinstance(value, ast.AST):
            out.append(value)
        elif isinstance(value, list):
            out.extend([x for x in value if isinstance(x, ast.AST)])
    return out


def stmt_first_line(node):
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", ())])


# ---------------------------------------------------------------------------------------------------- the settings


def settings_table(tree):
    """{attribute: (NAME, kind)} of Hyperparameters' settings, and the names MACHINE_SETTINGS lists."""
    table, machine = {}, set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "MACHINE_SETTINGS"
                                                for t in node.targets):
            machine = set(ast.literal_eval(node.value))
        if isinstance(node, ast.ClassDef) and node.name == "Hyperparameters":
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Assign) and len(sub.targets) == 1 and isinstance(sub.targets[0], ast.Attribute)
                        and isinstance(sub.value, ast.Call) and isinstance(sub.value.func, ast.Attribute)
                        and sub.value.func.attr in ("_env", "_env_int_list")):
                    args = sub.value.args
                    kind = ("list" if sub.value.func.attr == "_env_int_list" else
                            args[2].id if len(args) > 2 else "int")
                    table[sub.targets[0].attr] = (args[0].value, kind)
            for sub in ast.walk(node):  # settings read into a local first (e.g. PHASED_TTT_PREFIX_DOCS)
                if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "_env"
                        and sub.args and isinstance(sub.args[0], ast.Constant)
                        and sub.args[0].value not in {n for n, _ in table.values()}):
                    table[f"<{sub.args[0].value}>"] = (sub.args[0].value, "local")
    return table, machine


def load_module(text, path):
    """A script's module (its definitions only: nothing runs below `if __name__ == '__main__'`): the full script's, to
    read a run's settings, or a specialised file's."""
    name = "_specialise_source"
    mod = types.ModuleType(name)
    mod.__file__ = str(path)
    sys.modules[name] = mod
    try:
        exec(compile(text, str(path), "exec"), mod.__dict__)
    finally:
        sys.modules.pop(name, None)
    return mod


def run_settings(module, run):
    """Hyperparameters of the run: PRESET and the VAR=VALUE given, nothing else from the environment."""
    env = {"RUN_ID": "specialise", **run}
    try:
        return module.Hyperparameters(env)
    except module.ConfigError as e:
        raise SpecialiseError(f"the run's settings are refused by the full script: {e}") from None


# ---------------------------------------------------------------------------------------------------- the analysis


def is_literal(v):
    if isinstance(v, _LITERAL_TYPES):
        return True
    return isinstance(v, tuple) and all(is_literal(x) for x in v)


def literal_text(v):
    return repr(v)


def past_docstring(fn):
    """A function's statements after its docstring (a leading constant expression), if any."""
    return fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body


def run_value(h, attr, setting):
    """The run's value of setting `attr` ((NAME, kind) in settings_table): its attribute's, or for a setting read into
    a local (`<NAME>`, kind local) the value read, as Hyperparameters.effective records it (what
    Hyperparameters._check_specialised compares; equal to the attribute for every other setting)."""
    return h.effective[setting[0]][0] if setting[1] == "local" else getattr(h, attr)


class Analysis:
    """One pass over a source: what is known, and the text edits that fold it."""

    def __init__(self, src: Source, table, machine, h, conditions):
        self.src, self.table, self.h = src, table, h
        self.conditions = conditions  # NAME -> {(op, literal): result}, accumulated over passes
        tree = src.tree
        self.classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        self.functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        self.parents, self.fn_of, self.cls_of = {}, {}, {}
        self.loads_in, self.stores_in = {}, {}  # function -> names it loads; -> {name: times bound (99: a parameter,
        # a global or nonlocal)}
        self._settings_memo, self._names_memo, self._open = None, None, 0  # setting_of's and _value's of a Name
        # (from the end of __init__ on); how many tables of a function (local_aliases, local_consts, local_truths,
        # param_consts) are being worked out: one in the making gives a part of its entries
        self._index(tree, None, None)
        self.all_nodes = list(self.fn_of)
        self.hot = None
        self.bound = {}  # function -> names bound in it (parameters, assignments)
        # settings whose attribute is assigned outside Hyperparameters.__init__ (or more than once in it)
        stores_out, stores_init = set(), {}
        hp = self.classes.get("Hyperparameters")
        init = next((f for f in hp.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None) if hp else None
        init_nodes = set(src.walk(init)) if init else set()
        for node in self.of_type(*_STORE_STATEMENTS):
            for target in self._store_targets(node):
                if isinstance(target, ast.Attribute) and target.attr in table:
                    if target in init_nodes and isinstance(target.value, ast.Name) and target.value.id == "self":
                        stores_init[target.attr] = stores_init.get(target.attr, 0) + 1
                    elif self._is_settings_base(target.value, node):
                        stores_out.add(target.attr)
        for node in self.of_type(ast.Call):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                stores_out.add(node.args[1].value)  # setattr(obj, "name", ...): a store of that name
        self.init_nodes = init_nodes
        self.multi_init = {a for a, n in stores_init.items() if n > 1}
        dynamic = self._setattr_on_settings()
        self.foldable = {}  # attr -> (NAME, kind): settings whose predicates fold
        for attr, (name, kind) in table.items():
            if name in machine or kind == "list" or attr in stores_out or dynamic:
                continue
            if kind == "float" and run_value(h, attr, (name, kind)) != 0:
                continue  # a float is a value, but at 0 it switches a technique off: then known outright, as a bool
            self.foldable[attr] = (name, kind)
        # a setting known outright: a bool, a float at 0, one the run has recorded equal to a literal, or an int or
        # str recorded false (0 or "": the only false values of its kind)
        self.known_settings = {}
        for attr, (name, kind) in self.foldable.items():
            value = self.run_value(attr)
            recorded = conditions.get(name, {})
            if kind in ("bool", "float") or any(op == "==" and res for (op, _), res in recorded.items()) or (
                    kind in ("int", "str") and recorded.get(("truth", None)) is False and type(value).__name__ == kind):
                if is_literal(value):
                    self.known_settings[attr] = value
        self._collect_constants(tree)
        self._settings_memo, self._names_memo = {}, {}

    # -- helpers

    def run_value(self, attr):
        return run_value(self.h, attr, self.foldable[attr])

    def _store_targets(self, node):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        else:
            return []
        out = []
        for t in targets:
            out.extend(x for x in self.src.walk(t) if isinstance(x, (ast.Attribute, ast.Name, ast.Subscript)))
        return out

    def _setattr_on_settings(self):
        """Whether some setattr(obj, name, ...) with a computed name may set a setting (obj a settings object)."""
        return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                   and len(node.args) > 1 and not isinstance(node.args[1], ast.Constant)
                   and self._is_settings_base(node.args[0], node) for node in self.of_type(ast.Call))

    def _index(self, node, fn, cls):
        """parents; for each node its innermost function, and the class whose method it is in (`self`'s class); the
        nodes by class (by_type), the Name nodes by name (names) and the nodes of _ORDERED_CLASSES in one list, each
        in all_nodes' order. Makes the Source's kids where it has none yet (this walk's child lists: one walk instead
        of two)."""
        src = self.src
        kids = src._kids
        made = kids is None
        if made:
            kids = {}
        parents, fn_of, cls_of = self.parents, self.fn_of, self.cls_of
        loads_in, stores_in = self.loads_in, self.stores_in
        by_type, ordered, names = collections.defaultdict(list), [], collections.defaultdict(list)
        stack = [(node, fn, cls)]
        while stack:
            node, fn, cls = stack.pop()
            fn_of[node] = fn
            cls_of[node] = cls
            kind = node.__class__  # a tree of ast.parse's: isinstance(node, C) for a leaf class C is kind is C
            by_type[kind].append(node)
            if kind is ast.Name or kind is ast.Constant:  # no child but its context (a Name's id, a Constant's value)
                if made:
                    kids[node] = _NO_CHILDREN
                if kind is ast.Name:
                    names[node.id].append(node)
                if kind is ast.Name and fn is not None:
                    if isinstance(node.ctx, ast.Load):
                        if fn in loads_in:
                            loads_in[fn].add(node.id)
                        else:
                            loads_in[fn] = {node.id}
                    else:
                        c = stores_in.setdefault(fn, {})
                        c[node.id] = c.get(node.id, 0) + 1
                continue
            if kind in _ORDERED_CLASSES:
                ordered.append(node)
            if fn is not None and (kind is ast.Global or kind is ast.Nonlocal or kind is ast.arg):
                c = stores_in.setdefault(fn, {})
                for n in (node.names if kind is not ast.arg else [node.arg]):
                    c[n] = c.get(n, 0) + 99
            if made:
                kids[node] = children = child_nodes(node)
            else:
                children = kids[node]
            if kind is ast.FunctionDef or kind is ast.AsyncFunctionDef:
                parent = parents.get(node)
                fn, cls = node, (parent.name if isinstance(parent, ast.ClassDef) else cls)
            elif kind is ast.ClassDef:
                cls = None
            if len(children) == 1:
                child = children[0]
                parents[child] = node
                stack.append((child, fn, cls))
            else:  # the same entries in the same order, the loop in C
                parents.update(zip(children, itertools.repeat(node)))
                stack.extend(zip(children, itertools.repeat(fn), itertools.repeat(cls)))
        self.by_type, self.ordered, self.names = by_type, ordered, names
        if made:
            src._kids = kids
        if src._by_type is None:
            src._by_type = by_type

    def of_type(self, *classes):
        """The nodes of these leaf classes, class by class (all_nodes' order within each): for tests whose result no
        order changes."""
        return [node for c in classes for node in self.by_type.get(c, ())]

    def enclosing_class(self, node):
        return self.cls_of.get(node)

    def _is_settings_base(self, base, at):
        if isinstance(base, ast.Name) and base.id == "h":
            return True
        if isinstance(base, ast.Attribute) and base.attr == "h":
            return True
        return isinstance(base, ast.Name) and base.id == "self" and self.enclosing_class(at) == "Hyperparameters"

    def setting_of(self, node):
        """The foldable setting attribute `node` reads (h.X, rt.h.X, self.h.X, self.X in Hyperparameters, a local
        assigned once from one of those at its function's top level, or `self.a` where every store of `.a` in the
        file copies one: attr_aliases), or None. Remembered once the analysis is made (its tables complete) where no
        function's table is being worked out (_open)."""
        if node.__class__ is not ast.Name and node.__class__ is not ast.Attribute:
            return None
        memo = self._settings_memo
        if memo is None or self._open:
            return self._setting_of(node)
        found = memo.get(node, memo)
        if found is memo:
            found = memo[node] = self._setting_of(node)
        return found

    def _setting_of(self, node):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            fn = self.fn_of.get(node)
            return self.local_aliases(fn).get(node.id) if fn is not None else None
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Name)
                and node.value.id == "self" and self.attr_aliases):
            alias = self.attr_aliases.get((self.families.get(self.enclosing_class(node)), node.attr))
            if alias is not None:
                return alias
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr in self.foldable
                and self._is_settings_base(node.value, node)):
            if node in self.init_nodes and node.attr in self.multi_init:
                return None  # in __init__ before its last assignment the value may differ
            return node.attr
        return None

    # -- constants: locals, globals, attributes

    def _collect_constants(self, tree):
        self.global_consts, self.attr_aliases = {}, {}
        declared_global = {n for node in self.of_type(ast.Global, ast.Nonlocal) for n in node.names}
        assigned = {}
        for node in tree.body:
            for t in self._store_targets(node):
                if isinstance(t, ast.Name):
                    assigned.setdefault(t.id, []).append(node)
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)):
                for name in ([node.name] if hasattr(node, "name") else
                             [a.asname or a.name.split(".")[0] for a in node.names]):
                    assigned.setdefault(name, []).append(node)
        for name, nodes in assigned.items():
            node = nodes[0]
            if (len(nodes) == 1 and name not in declared_global and isinstance(node, ast.Assign)
                    and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, ast.Constant) and is_literal(node.value.value)):
                self.global_consts[name] = node.value.value
        # attributes: every store of `.a` in the file
        self.families = self._class_families()
        stores, blocked = {}, set()  # blocked: families a computed-name setattr may write ("*": any)
        for node in self.ordered:
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    self._attr_stores(t, node.value, node, stores)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor, ast.Delete, ast.With)):
                walk = self.src.walk
                for t in walk(node.target if hasattr(node, "target") else node) if not isinstance(node, ast.With) \
                        else [x for item in node.items if item.optional_vars for x in walk(item.optional_vars)]:
                    if isinstance(t, ast.Attribute) and isinstance(t.ctx, (ast.Store, ast.Del)):
                        stores.setdefault(t.attr, []).append((None, None, UNKNOWN))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
                if len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                    stores.setdefault(node.args[1].value, []).append((None, None, UNKNOWN))
                else:  # a computed name: any attribute of the object's class family, of every family if not known
                    blocked.add(self.families.get("Hyperparameters") if len(node.args) > 1
                                and self._settings_object(node.args[0], node) else "*")
            elif isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else \
                        [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
                    for t in targets:
                        if isinstance(t, ast.Name):
                            stores.setdefault(t.id, []).append((node.name, None, UNKNOWN))
        self.attr_stores = stores
        self.literal_properties = self._literal_properties(stores)
        self.attr_consts = {}  # (family root, attr) -> value
        self.cell_consts = {}
        if "*" not in blocked:
            self._collect_attr_consts(stores, blocked)
        self._collect_cell_consts(assigned, declared_global)
        for memo in ("_memo", "_params", "_aliases"):  # worked out before the tables were complete: UNKNOWN too often
            self.__dict__.pop(memo, None)

    def _literal_properties(self, stores):
        """{name: value} of Hyperparameters' properties whose body (past its docstring) only returns a literal, or an
        empty list ([]: false in a condition, unknown otherwise: a new list each read), e.g. seq_len_phases once
        TRAIN_SEQ_LEN_SCHEDULE is known unset; none that any store in the file may shadow."""
        hp, out = self.classes.get("Hyperparameters"), {}
        for fn in hp.body if hp is not None else ():
            if not isinstance(fn, ast.FunctionDef):
                continue
            body = past_docstring(fn)
            if (len(body) == 1 and isinstance(body[0], ast.Return)
                    and [ast.unparse(d) for d in fn.decorator_list] == ["property"] and fn.name not in stores):
                ret = body[0].value
                if isinstance(ret, ast.List) and not ret.elts:
                    out[fn.name] = []
                elif ret is not None and not isinstance(ret, (ast.List, ast.Dict, ast.Set)):
                    try:
                        value = ast.literal_eval(ret)
                    except ValueError:
                        continue
                    if is_literal(value):
                        out[fn.name] = value
        return out

    def _settings_object(self, node, at):
        """Whether `node` is a settings object: h, rt.h, self in Hyperparameters, or a local of its function assigned
        once from copy.copy of one (project_replay's real-run settings)."""
        if self._is_settings_base(node, at):
            return True
        fn = self.fn_of.get(at)
        if not (isinstance(node, ast.Name) and fn is not None and self._store_counts(fn).get(node.id) == 1):
            return False
        for stmt in self.src.walk(fn):
            if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                    and stmt.targets[0].id == node.id):
                v = stmt.value
                return (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "copy"
                        and isinstance(v.func.value, ast.Name) and v.func.value.id == "copy" and len(v.args) == 1
                        and self._is_settings_base(v.args[0], stmt))
        return False

    def _collect_cell_consts(self, assigned, declared_global):
        """Module cells: `NAME = [literal]` assigned once, and NAME only ever read or stored as NAME[0], every store
        of NAME[0] the same literal (e.g. _PREFLIGHT's None where the run has no rehearsal): NAME[0] is it."""
        cells = {}
        for name, nodes in assigned.items():
            node = nodes[0]
            if (len(nodes) == 1 and name not in declared_global and isinstance(node, ast.Assign)
                    and len(node.targets) == 1 and isinstance(node.value, ast.List) and len(node.value.elts) == 1
                    and isinstance(node.value.elts[0], ast.Constant) and is_literal(node.value.elts[0].value)):
                cells[name] = (node.value.elts[0].value, node.targets[0])
        stores = {name: [] for name in cells}
        for node in (node for name in cells for node in self.names.get(name, ())):  # each cell's Names, in order
            if not (isinstance(node, ast.Name) and node.id in cells) or node is cells[node.id][1]:
                continue
            sub = self.parents.get(node)
            if not (isinstance(sub, ast.Subscript) and sub.value is node and isinstance(sub.slice, ast.Constant)
                    and sub.slice.value == 0 and isinstance(node.ctx, ast.Load)):
                stores[node.id] = None  # used otherwise: passed on, rebound, sliced
            elif isinstance(sub.ctx, ast.Store) and stores[node.id] is not None:
                stmt = self.parents.get(sub)
                stores[node.id].append(stmt.value if isinstance(stmt, ast.Assign) and sub in stmt.targets else None)
            elif not isinstance(sub.ctx, (ast.Load, ast.Store)):
                stores[node.id] = None
        for name, values in stores.items():
            if values is None:
                continue
            first = cells[name][0]
            got = [self.value(v) if v is not None else UNKNOWN for v in values]
            if all(v is not UNKNOWN and v is not NOT_NONE and is_literal(v) and (type(v), v) == (type(first), first)
                   for v in got):
                self.cell_consts[name] = first

    def _collect_attr_consts(self, stores, blocked):
        """attr_consts: an attribute every store in the file (one class family, all through `self`) sets alike; none
        for a family some computed-name setattr may write (`blocked`). attr_aliases: one stored once, from a foldable
        setting."""
        for attr, entries in stores.items():
            fams = {self.families.get(cls) for cls, _, _ in entries}
            if len(fams) != 1 or None in fams or fams & blocked:
                continue
            setting = self.setting_of(entries[0][1]) if len(entries) == 1 and entries[0][1] is not None else None
            if setting is not None:  # `self.stop_at = h.eval_ttt_stop_at`, its one store: a read of it is the setting's
                self.attr_aliases[(fams.pop(), attr)] = setting
                continue
            values = []
            for cls, value_node, hint in entries:
                if hint is UNKNOWN and value_node is None:
                    values = None
                    break
                values.append(self.value(value_node, in_class=cls) if value_node is not None else hint)
            if not values or any(v is UNKNOWN for v in values):
                continue
            if all(v is NOT_NONE or (v is not None and not isinstance(v, _LITERAL_TYPES)) for v in values):
                self.attr_consts[(fams.pop(), attr)] = NOT_NONE
            elif all(v is not NOT_NONE and is_literal(v) for v in values) and len({(type(v), v) for v in values}) == 1:
                self.attr_consts[(fams.pop(), attr)] = values[0]

    def _attr_stores(self, target, value, stmt, stores):
        if isinstance(target, (ast.Tuple, ast.List)):
            elts = value.elts if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts) else None
            for i, t in enumerate(target.elts):
                self._attr_stores(t, elts[i] if elts else None, stmt, stores)
            return
        if isinstance(target, ast.Starred):
            self._attr_stores(target.value, None, stmt, stores)
            return
        if not isinstance(target, ast.Attribute):
            return
        if isinstance(target.value, ast.Name) and target.value.id == "self" and value is not None:
            cls = self.enclosing_class(stmt)
            stores.setdefault(target.attr, []).append((cls, value, None) if cls else (None, None, UNKNOWN))
        else:
            stores.setdefault(target.attr, []).append((None, None, UNKNOWN))

    def _class_families(self):
        """class name -> the root of its family (classes of the file joined by inheritance)."""
        parent = {name: name for name in self.classes}

        def root(x):
            while parent[x] != x:
                x = parent[x]
            return x
        for name, node in self.classes.items():
            for b in node.bases:
                if isinstance(b, ast.Name) and b.id in self.classes:
                    parent[root(name)] = root(b.id)
        return {name: root(name) for name in self.classes}

    def assigned_once(self, fn, plain=False):
        """(name, value) of the locals of `fn` bound once, by an assignment at its top level: `a = v`, and unless
        `plain`, `a = b = v` and `a, b = v, w` (a tuple of as many values)."""
        cache = self.__dict__.get("_once")
        if cache is None:
            cache = self.__dict__["_once"] = {}
        if fn not in cache:
            counts, cache[fn] = self._store_counts(fn), []
            for stmt in fn.body:
                for target in stmt.targets if isinstance(stmt, ast.Assign) else ():
                    pairs = [(target, stmt.value)] if isinstance(target, ast.Name) else \
                        list(zip(target.elts, stmt.value.elts)) if isinstance(target, ast.Tuple) and \
                        isinstance(stmt.value, ast.Tuple) and len(target.elts) == len(stmt.value.elts) else []
                    cache[fn] += [(t.id, v, len(stmt.targets) == 1 and t is target) for t, v in pairs
                                  if isinstance(t, ast.Name) and counts.get(t.id) == 1]
        return [(name, value) for name, value, single in cache[fn] if single or not plain]

    def local_aliases(self, fn):
        """Locals of `fn` assigned once, at its top level, from a foldable setting (e.g. `text = h.train_clock`, or in
        Hyperparameters `prefix = self._env("PHASED_TTT_PREFIX_DOCS", ...)`: the setting `<NAME>`), and its parameters
        that every call gives one (param_aliases)."""
        cache = self.__dict__.get("_aliases")
        if cache is None:
            cache = self.__dict__["_aliases"] = {}
        if fn not in cache:
            cache[fn] = {}
            self._open += 1
            try:
                for name, value in self.assigned_once(fn, plain=True):
                    attr = self.setting_of(value) if isinstance(value, ast.Attribute) else self._env_read(value)
                    if attr is not None:
                        cache[fn][name] = attr
                cache[fn].update(self.param_aliases(fn))
            finally:
                self._open -= 1
        return cache[fn]

    def _env_read(self, value):
        """`<NAME>` when `value` is `self._env("NAME", ...)` in a Hyperparameters method and NAME a foldable setting
        read into a local, else None."""
        if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "_env"
                and isinstance(value.func.value, ast.Name) and value.func.value.id == "self" and value.args
                and isinstance(value.args[0], ast.Constant) and self.enclosing_class(value) == "Hyperparameters"):
            attr = f"<{value.args[0].value}>"
            return attr if attr in self.foldable else None
        return None

    def call_arguments(self, fn):
        """{parameter: [the node each call in the file gives it (its default where a call leaves it out; None: no
        value)]} of module function `fn` (or of a class's __init__: its constructions), for the parameters it never
        rebinds; {} where its callers are not all known (its name read other than as a call, *args or **kwargs
        anywhere)."""
        memo = self.__dict__.get("_arguments")
        if memo is None:
            memo = self.__dict__["_arguments"] = {}
        if fn in memo:
            return memo[fn]
        memo[fn] = {}
        a, skip = fn.args, 0
        calls = self.calls_of(fn.name) if self.functions.get(fn.name) is fn and not fn.decorator_list else None
        cls = self.parents.get(fn)
        if (fn.name == "__init__" and not fn.decorator_list and isinstance(cls, ast.ClassDef)
                and self.classes.get(cls.name) is cls and self._constructed_by_name(cls)):
            calls, skip = self.calls_of(cls.name), 1  # its constructions bind its parameters after self
        elif isinstance(cls, ast.ClassDef) and not fn.decorator_list and fn.args.args:
            calls, skip = self.method_calls(fn), 1  # obj.name(...) binds its parameters after self
        if not calls or a.vararg or a.kwarg or a.posonlyargs or any(
                isinstance(x, ast.Starred) for c in calls for x in c.args) or any(k.arg is None for c in calls
                                                                                 for k in c.keywords):
            return memo[fn]
        counts = self._store_counts(fn)
        positional = [x.arg for x in a.args]
        defaults = dict(zip(positional[len(positional) - len(a.defaults):], a.defaults))
        positional = positional[skip:]
        defaults.update((x.arg, d) for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None)
        for name in positional + [x.arg for x in a.kwonlyargs]:
            if counts.get(name) != 99:  # rebound in fn, or a name of a nested function too
                continue
            i = positional.index(name) if name in positional else None
            nodes = []
            for call in calls:
                given = [k.value for k in call.keywords if k.arg == name]
                nodes.append(call.args[i] if i is not None and i < len(call.args) else given[0] if given else
                             defaults.get(name))
            memo[fn][name] = nodes
        return memo[fn]

    def _constructed_by_name(self, cls):
        """Whether every construction of class `cls` is a call of its name (calls_of: its name read otherwise, e.g. as
        a subclass's base, whose construction reaches its __init__ through super(), leaves its callers unknown): it
        never constructs itself otherwise (cls(...), type(self)(...), self.__class__) and no `type(x)(...)` in the
        file may build it."""
        if not self._typed_constructions_builtin():
            return False
        blocked = self.__dict__.get("_self_building")
        if blocked is None:  # the classes above some Name cls, type or __class__ or some .__class__: once, not a walk
            # of each class
            blocked = self._self_building = set()
            hits = [n for name in ("cls", "type", "__class__") for n in self.names.get(name, ())]
            hits += [n for n in self.by_type.get(ast.Attribute, ()) if n.attr == "__class__"]
            for n in hits:
                while n is not None:
                    if isinstance(n, ast.ClassDef):
                        blocked.add(n)
                    n = self.parents.get(n)
        return cls not in blocked

    def _typed_constructions_builtin(self):
        """Whether every `type(x)(...)` in the file constructs a builtin: it sits in `if isinstance(x, T)` with T
        builtin names only (to_host's list or tuple); `x.__class__(...)` anywhere: no."""
        memo = self.__dict__.setdefault("_typed", [])
        if not memo:
            ok = True
            for node in self.of_type(ast.Call):
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                if isinstance(f, ast.Attribute) and f.attr == "__class__":
                    ok = False
                elif isinstance(f, ast.Call) and isinstance(f.func, ast.Name) and f.func.id == "type" and f.args:
                    x, up = ast.unparse(f.args[0]), self.parents.get(node)
                    while up is not None and not isinstance(up, ast.If):
                        up = self.parents.get(up)
                    test = up.test if up is not None else None
                    kinds = test.args[1] if isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and \
                        test.func.id == "isinstance" and len(test.args) == 2 and ast.unparse(test.args[0]) == x \
                        else None
                    names = kinds.elts if isinstance(kinds, ast.Tuple) else [kinds] if kinds is not None else []
                    if not names or not all(isinstance(n, ast.Name) and n.id not in self.classes for n in names):
                        ok = False
            memo.append(ok)
        return memo[0]

    def param_aliases(self, fn):
        """Parameters of `fn` (call_arguments) that every call gives the same foldable setting (compress(blob,
        h.compressor)): a predicate on one is a predicate on that setting."""
        if not isinstance(fn, ast.FunctionDef):
            return {}
        out = {}
        for name, nodes in self.call_arguments(fn).items():
            attrs = {self.setting_of(n) if n is not None else None for n in nodes}
            if len(attrs) == 1 and None not in attrs:
                out[name] = attrs.pop()
        return out

    def _store_counts(self, fn):
        """{name: times bound} in fn and the functions nested in it (parameters, globals, nonlocals: 99)."""
        cache = self.__dict__.get("_counts")
        if cache is None:
            cache = self.__dict__["_counts"] = {}
        if fn in cache:
            return cache[fn]
        self.loads_anywhere_in(fn, "")  # builds the nesting map
        counts = dict(self.stores_in.get(fn, {}))
        for inner in self._nested.get(fn, ()):
            for name, n in self.stores_in.get(inner, {}).items():
                counts[name] = counts.get(name, 0) + n
        cache[fn] = counts
        return counts

    def returned_keys(self, name):
        """The keys of the dict module function `name` returns, when its last statement is
        `return {k: v for k, v in A.items() if B[k]}` with A and B dict displays of str keys and B's values known."""
        cache = self.__dict__.setdefault("_keys", {})
        if name in cache:
            return cache[name]
        cache[name] = None
        fn = self.functions.get(name)
        if fn is None or not isinstance(fn.body[-1], ast.Return) or not isinstance(fn.body[-1].value, ast.DictComp):
            return None
        comp = fn.body[-1].value
        gen = comp.generators[0] if len(comp.generators) == 1 else None
        if (gen is None or len(gen.ifs) != 1 or not isinstance(gen.iter, ast.Call)
                or not isinstance(gen.iter.func, ast.Attribute) or gen.iter.func.attr != "items"
                or not isinstance(gen.iter.func.value, ast.Name) or not isinstance(gen.target, ast.Tuple)):
            return None
        test, key = gen.ifs[0], gen.target.elts[0]
        if not (isinstance(test, ast.Subscript) and isinstance(test.value, ast.Name) and isinstance(test.slice, ast.Name)
                and isinstance(key, ast.Name) and test.slice.id == key.id):
            return None
        displays = {}
        counts = self._store_counts(fn)
        for stmt in fn.body:
            if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                    and isinstance(stmt.value, ast.Dict) and counts.get(stmt.targets[0].id) == 1
                    and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in stmt.value.keys)):
                displays[stmt.targets[0].id] = stmt.value
        a, b = displays.get(gen.iter.func.value.id), displays.get(test.value.id)
        if a is None or b is None:
            return None
        on = {k.value: self.value(v) for k, v in zip(b.keys, b.values)}
        if any(v is UNKNOWN or v is NOT_NONE for v in on.values()):
            return None
        cache[name] = [k.value for k in a.keys if on.get(k.value)]
        return cache[name]

    def _builtin_call(self, node):
        """getattr(x, "a", DEFAULT) and hasattr(x, "a") of an attribute no object can have (attribute_absent):
        DEFAULT, False; tuple(generator) of a generator that yields nothing (_empty_iteration): (); obj.m() of a
        method whose result is known (method_result)."""
        f, args = node.func, node.args
        if isinstance(f, ast.Attribute) and not args and not node.keywords:
            return self.method_result(f.attr)
        if not isinstance(f, ast.Name) or node.keywords or not self._builtin_name(f):
            return UNKNOWN
        if f.id in ("getattr", "hasattr") and len(args) == (3 if f.id == "getattr" else 2) \
                and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str) \
                and self._walked_module(args[0]) and self.attribute_absent(args[1].value):
            return self.value(args[2]) if f.id == "getattr" else False
        if f.id == "tuple" and len(args) == 1 and isinstance(args[0], ast.GeneratorExp) \
                and self._empty_iteration(args[0]):
            return ()
        return UNKNOWN

    def _builtin_name(self, name):
        """Whether Name node `name` reads the builtin of its name: nothing in the file binds it."""
        fn = self.fn_of.get(name)
        return not (name.id in self.functions or name.id in self.classes or name.id in self.global_consts
                    or name.id in self._module_names() or (fn is not None and self._bound_in(fn, name.id)))

    def _module_names(self):
        names = self.__dict__.get("_module_bound")
        if names is None:
            names = self._module_bound = {n.id for n in self.by_type.get(ast.Name, ()) if not isinstance(n.ctx, ast.Load)
                                          and self.fn_of.get(n) is None}
            names.update(a.asname or a.name.split(".")[0] for k in (ast.Import, ast.ImportFrom)
                         for i in self.by_type.get(k, ()) for a in i.names)
        return names

    def _walked_module(self, node):
        """Whether `node` is a module of a model's walk: the target name of a comprehension's `for` over MODULE_WALKS
        (`getattr(m, "reads", ())` in `... for m in self.modules() ...`). A library's own objects (a module such as
        triton or torch.distributed, probed with getattr for a feature) are never this."""
        if not isinstance(node, ast.Name):
            return False
        up = self.parents.get(node)
        while up is not None and not isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            if isinstance(up, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
                for comp in up.generators:
                    if isinstance(comp.target, ast.Name) and comp.target.id == node.id:
                        it = comp.iter
                        return isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) \
                            and it.func.attr in MODULE_WALKS and not it.args and not it.keywords
            up = self.parents.get(up)
        return False

    @staticmethod
    def _quiet(node):
        """Whether evaluating `node` changes nothing: a name, a constant, or an attribute of one."""
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, (ast.Name, ast.Constant))

    def _empty_iteration(self, gen):
        """Whether a comprehension yields nothing: one of its `for`s runs over a known empty literal, or one of its
        `if`s is known false, and what runs before that changes nothing (each `for` before it over a quiet name or
        a WALK_METHODS call of one, each `if` before it calling nothing)."""
        for comp in gen.generators:
            if comp.is_async:
                return False
            it = self.value(comp.iter)
            if isinstance(it, (tuple, str)) and not it and it is not UNKNOWN:
                return True
            walk = comp.iter.func if isinstance(comp.iter, ast.Call) and not comp.iter.args \
                and not comp.iter.keywords else None
            if not (self._quiet(comp.iter) or isinstance(walk, ast.Attribute) and walk.attr in WALK_METHODS
                    and self._quiet(walk.value)):
                return False
            for test in comp.ifs:
                if self.value(test, cond=True) is False:
                    return True
                if any(isinstance(x, ast.Call) for x in self.src.walk(test)):
                    return False
        return False

    def attribute_absent(self, name, but=()):
        """Whether no module of the model (nor an object of the file's) can have an attribute `name`: nothing in the
        file binds it (no store `x.name`, no
        module or class-body binding, def, class or import of it, no keyword `name=` of a call, no word of a string
        made of names only, e.g. a setattr's or namedtuple's, but the getattr/hasattr arguments asking for it), it is
        no attribute of Python's and torch's base types (object, the builtin containers, nn.Module, Tensor), and it is
        no dunder. The file's setattr with a computed name set only names its strings give (Schedule.STATE) or that
        it binds elsewhere (Hyperparameters' settings); torch.nn's module classes are assumed to hold none of the
        file's own protocol names (`reads`, `term_weight`, `block_branch`) beyond those base types, none of their
        class attributes (checked). but: kinds of binding ("defs", "strings", ...) left out."""
        tables = self._attribute_bindings()
        import torch
        return name.isidentifier() and not name.startswith("__") and not self.base_attribute(name) and not any(
            name in names for kind, names in tables.items() if kind not in but and kind != "asked") and not any(
            isinstance(c, type) and hasattr(c, name) for c in vars(torch.nn).values())

    def _attribute_bindings(self):
        """{kind: the attribute names the file binds that way} (attribute_absent)."""
        tables = self.__dict__.get("_bindings")
        if tables is None:
            calls = self.by_type.get(ast.Call, ())
            asked = {id(c.args[1]) for c in calls
                     if isinstance(c.func, ast.Name) and c.func.id in ("getattr", "hasattr") and len(c.args) > 1}
            strings = set()
            for n in self.by_type.get(ast.Constant, ()):
                if isinstance(n.value, str) and id(n) not in asked:
                    words = n.value.replace(",", " ").replace(".", " ").split()
                    if all(w.isidentifier() for w in words):
                        strings.update(words)
            tables = self._bindings = {
                "stores": {n.attr for n in self.by_type.get(ast.Attribute, ()) if not isinstance(n.ctx, ast.Load)},
                "module": self._module_names(),
                "defs": {n.name for k in (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
                         for n in self.by_type.get(k, ())},
                "keywords": {k.arg for c in calls for k in c.keywords if k.arg},
                "strings": strings,
                "asked": {c.args[1].value for c in calls if len(c.args) > 1 and id(c.args[1]) in asked  # reads
                          and isinstance(c.args[1], ast.Constant) and isinstance(c.args[1].value, str)}}
        return tables

    @staticmethod
    def base_attribute(name):
        """Whether `name` is an attribute of a base type of Python's or torch's (the containers, files, exceptions,
        nn.Module, Linear, Embedding, Tensor, Optimizer, autograd.Function): one that library code may call or read
        on an object of the file's, by its base class or by its protocol."""
        import io
        import torch
        return any(hasattr(t, name) for t in (object, tuple, list, dict, set, str, bytes, int, float, io.IOBase,
                                              Exception, torch.nn.Module, torch.nn.Linear, torch.nn.Embedding,
                                              torch.Tensor, torch.optim.Optimizer, torch.autograd.Function))

    def method_result(self, name):
        """The literal obj.name() returns where `name` is the method of one class in the file and nothing else binds
        it (attribute_absent, its def aside: no other object has it), undecorated, whose body (after a docstring) is
        one `return EXPR` of a known literal."""
        methods = self._methods_by_name().get(name, ())
        fn = methods[0] if len(methods) == 1 else None
        if fn is None or fn.decorator_list or name in HOOK_METHODS or len(fn.args.args) != 1 or fn.args.vararg \
                or fn.args.kwarg or not self.attribute_absent(name, but=("defs",)) or sum(
                    1 for k in (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef) for n in self.by_type.get(k, ())
                    if n.name == name) != 1:
            return UNKNOWN
        body = past_docstring(fn)
        if len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is not None:
            v = self.value(body[0].value)
            return v if v is not NOT_NONE and is_literal(v) else UNKNOWN
        return UNKNOWN

    def _methods_by_name(self):
        methods = self.__dict__.get("_methods")
        if methods is None:
            methods = self._methods = collections.defaultdict(list)
            for cls in self.by_type.get(ast.ClassDef, ()):
                for m in cls.body:
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        methods[m.name].append(m)
        return methods

    def _attributes_by_name(self):
        """The Attribute nodes by their attribute's name, each list in by_type's order (made once an analysis: every
        method's calls are looked up in it)."""
        attrs = self.__dict__.get("_attrs")
        if attrs is None:
            attrs = self._attrs = collections.defaultdict(list)
            for n in self.by_type.get(ast.Attribute, ()):
                attrs[n.attr].append(n)
        return attrs

    def method_calls(self, fn):
        """Every call that may run method `fn`: the calls `obj.NAME(...)` in the file, when every read of an attribute
        NAME is such a call and none goes through a class (`Class.NAME(obj, ...)`), no string names it (getattr),
        it is no dunder, no hook torch calls and no attribute of a base type (library code calling it). Calls of
        another object's NAME are among them: more to agree, never fewer. Else None."""
        name = fn.name
        if name.startswith("__") or name in HOOK_METHODS or self.base_attribute(name) \
                or name in self._attribute_bindings()["strings"] or name in self._attribute_bindings()["asked"]:
            return None
        calls = []
        for n in self._attributes_by_name().get(name, ()):
            parent = self.parents.get(n)
            if not (isinstance(n.ctx, ast.Load) and isinstance(parent, ast.Call) and parent.func is n) or (
                    isinstance(n.value, ast.Name) and n.value.id in self.classes):
                return None
            calls.append(parent)
        return calls

    def call_result(self, name):
        """The literal a module function always returns: its body (after a docstring) one `return LITERAL`."""
        fn = self.functions.get(name)
        if fn is None:
            return UNKNOWN
        body = past_docstring(fn)
        if len(body) == 1 and isinstance(body[0], ast.Return):
            v = self.value(body[0].value) if body[0].value is not None else None
            return v if v is not NOT_NONE and (v is None or is_literal(v)) else UNKNOWN
        return UNKNOWN

    def local_call(self, node):
        """The function name a local is assigned from once, at its function's top level (`plan = f(h)`, or in a tuple
        assignment: `plan, L = f(h), h.eval_seq_len`)."""
        fn = self.fn_of.get(node)
        if fn is None:
            return None
        for name, value in self.assigned_once(fn):
            if name == node.id and isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
                return value.func.id
        return None

    def local_consts(self, fn):
        """Locals of `fn` assigned once, at its top level, to a literal; not parameters, globals or closures."""
        cache = getattr(self, "_locals", None)
        if cache is None:
            cache = self._locals = {}
        if fn in cache:
            return cache[fn]
        out = {}
        cache[fn] = out
        self._open += 1
        try:
            for name, value in self.assigned_once(fn):
                v = self.value(value)
                if v is not UNKNOWN and v is not NOT_NONE and is_literal(v):
                    out[name] = v
        finally:
            self._open -= 1
        return out

    def local_truths(self, fn):
        """Locals of `fn` assigned once, at its top level, to an expression whose truth is known though its value is
        not (`clip = h.grad_clip_norm > 0 and h.grad_clip_scope == "reduced"`): {name: truth}, for conditions only."""
        cache = self.__dict__.get("_truths")
        if cache is None:
            cache = self.__dict__["_truths"] = {}
        if fn not in cache:
            cache[fn] = {}
            self._open += 1
            try:
                consts = self.local_consts(fn)
                for name, value in self.assigned_once(fn, plain=True):
                    v = self.value(value, cond=True) if name not in consts else UNKNOWN
                    if v is not UNKNOWN and v is not NOT_NONE and is_literal(v):
                        cache[fn][name] = bool(v)
            finally:
                self._open -= 1
        return cache[fn]

    def calls_of(self, name):
        """The calls of module function or class `name` in the file, or None where its name is read other than as a
        call's function (passed on, stored, decorated, a base class: its callers unknown)."""
        calls = self.__dict__.setdefault("_calls", None)
        if calls is None:
            calls = self._calls = {}
            for node in (node for name, nodes in self.names.items() if name in self.functions or name in self.classes
                         for node in nodes):  # name by name: a name's calls, in order, are all that it decides
                if isinstance(node, ast.Name) and (node.id in self.functions or node.id in self.classes):
                    parent = self.parents.get(node)
                    if isinstance(node.ctx, ast.Load) and isinstance(parent, ast.Call) and parent.func is node \
                            and calls.get(node.id, []) is not None:
                        calls.setdefault(node.id, []).append(parent)
                    else:
                        calls[node.id] = None
        return calls.get(name)

    def param_consts(self, fn):
        """Parameters of `fn` (call_arguments) that every call in the file gives the same literal (its default where a
        call leaves it out) and that `fn` never rebinds: {name: literal}."""
        memo = self.__dict__.get("_params")
        if memo is None:
            memo = self.__dict__["_params"] = {}
        if fn in memo:
            return memo[fn]
        memo[fn] = {}  # while it is worked out (a call inside a call's argument): nothing known
        out = {}
        self._open += 1
        try:
            for name, nodes in self.call_arguments(fn).items():
                values = [self.value(n) if n is not None else UNKNOWN for n in nodes]
                if all(v is not UNKNOWN and v is not NOT_NONE and is_literal(v) for v in values) \
                        and len({(type(v), v) for v in values}) == 1:
                    out[name] = values[0]
        finally:
            self._open -= 1
        memo[fn] = out
        return out

    # -- values

    def predicate(self, node):
        """(setting attr, op, literal) when `node` is a predicate of a foldable setting, else None."""
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            op = COMPARE_OPS.get(type(node.ops[0]))
            left, right = node.left, node.comparators[0]
            for s_node, l_node, flipped in ((left, right, False), (right, left, True)):
                attr = self.setting_of(s_node)
                if attr is None or op is None:
                    continue
                try:
                    lit = ast.literal_eval(l_node)
                except ValueError:
                    continue
                if not is_literal(lit) or isinstance(lit, float):
                    continue
                kind = self.foldable[attr][1]
                if op not in EQUALITY_OPS and kind != "int":
                    continue
                if flipped and op in ("in", "not in"):
                    continue  # `lit in setting`: a substring test
                if flipped:
                    op = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}.get(op, op)
                return attr, op, lit
        return None

    def record(self, attr, op, lit):
        name = self.foldable[attr][0]
        result = bool(EVALUATE[op](self.run_value(attr), lit))
        self.conditions.setdefault(name, {})[(op, lit)] = result
        return result

    def value(self, node, cond=False, in_class=None):
        """What `node` evaluates to, if the analysis knows it (UNKNOWN otherwise; NOT_NONE: some object)."""
        if node is None:
            return UNKNOWN
        key = (node, cond, in_class)  # a node of the tree, alive as long as the analysis: itself, not its id
        memo = self.__dict__.get("_memo")
        if memo is None:
            memo = self.__dict__["_memo"] = {}
        found = memo.get(key, memo)
        if found is memo:
            found = memo[key] = self._value(node, cond, in_class)
        return found

    def _value(self, node, cond=False, in_class=None):
        # each case tests the node's class first (a tree of ast.parse's: isinstance of a leaf class is `is`); the cases
        # a class can meet stay in their order
        if node is None:
            return UNKNOWN
        kind = node.__class__
        if kind is ast.Constant:
            return node.value
        if kind is ast.Tuple and isinstance(node.ctx, ast.Load):
            vals = [self.value(e) for e in node.elts]
            return tuple(vals) if all(v is not UNKNOWN and v is not NOT_NONE and is_literal(v) for v in vals) else NOT_NONE
        if kind in _NEW_OBJECTS:
            return NOT_NONE
        if kind is ast.Call:
            if isinstance(node.func, ast.Name) and node.func.id in self.classes:
                return NOT_NONE
            if (isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "nn" and node.func.attr[:1].isupper()):
                return NOT_NONE
        if kind is ast.Name and self._names_memo is not None and not self._open and isinstance(node.ctx, ast.Load):
            # a loaded Name's value is its function's, name's and cond's, from tables that no longer change: once
            key = (self.fn_of.get(node), node.id, cond)
            found = self._names_memo.get(key, self._names_memo)
            if found is self._names_memo:
                found = self._read_value(node, cond, in_class)
                if not self._open:
                    self._names_memo[key] = found
            return found
        return self._read_value(node, cond, in_class, kind)

    def _read_value(self, node, cond, in_class, kind=ast.Name):
        """_value's cases for a Name or Attribute, any other node's after the first ones (`kind`: its class)."""
        if kind is ast.Name or kind is ast.Attribute:  # setting_of is None for any other node
            attr = self.setting_of(node)
            if attr is not None:
                if attr in self.known_settings:
                    self.record(attr, "==", self.known_settings[attr]) if self.foldable[attr][1] != "bool" else \
                        self.record(attr, "truth", None)
                    return self.known_settings[attr]
                if cond:
                    return self.record(attr, "truth", None)
                return UNKNOWN
        elif kind is ast.Compare:  # predicate is None for any other node
            pred = self.predicate(node)
            if pred is not None:
                return self.record(*pred)
        if kind is ast.Name:
            if isinstance(node.ctx, ast.Load):
                fn = self.fn_of.get(node)
                if fn is not None:
                    consts = self.local_consts(fn)
                    if node.id in consts:
                        return consts[node.id]
                    params = self.param_consts(fn) if isinstance(fn, ast.FunctionDef) else {}
                    if node.id in params:
                        return params[node.id]
                    truths = self.local_truths(fn) if cond else {}
                    if node.id in truths:
                        return truths[node.id]
                    if self._bound_in(fn, node.id):
                        return UNKNOWN
                return self.global_consts.get(node.id, UNKNOWN)
            return UNKNOWN
        if kind is ast.Attribute:
            if (isinstance(node.ctx, ast.Load) and self._is_settings_base(node.value, node)
                    and node.attr in self.literal_properties):
                return self.literal_properties[node.attr] if self.literal_properties[node.attr] != [] else \
                    (False if cond else NOT_NONE)
            if (isinstance(node.ctx, ast.Load) and self._is_settings_base(node.value, node)
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                # h.a, rt.h.a: an attribute Hyperparameters always sets to the same literal (e.g. h.clock)
                return self.attr_consts.get((self.families.get("Hyperparameters"), node.attr), UNKNOWN)
            if isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Name) and node.value.id == "self":
                cls = in_class or self.enclosing_class(node)
                fam = self.families.get(cls)
                if fam is not None and (fam, node.attr) in self.attr_consts:
                    return self.attr_consts[(fam, node.attr)]
                return UNKNOWN
            return UNKNOWN
        if kind is ast.Subscript:
            if (isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Name)
                    and node.value.id in self.cell_consts and isinstance(node.slice, ast.Constant)
                    and node.slice.value == 0):
                fn = self.fn_of.get(node)
                return UNKNOWN if fn is not None and self._bound_in(fn, node.value.id) else \
                    self.cell_consts[node.value.id]
            return UNKNOWN
        if kind is ast.UnaryOp:
            if isinstance(node.op, ast.Not):
                v = self.value(node.operand, cond=True)
                return UNKNOWN if v is UNKNOWN or v is NOT_NONE else (not v)
            return UNKNOWN
        if kind is ast.BoolOp:
            return self._boolop_value(node, cond)[0]
        if kind is ast.Call:
            if (isinstance(node.func, ast.Name) and node.func.id in self.functions
                    and not any(isinstance(x, ast.Call) for arg in node.args + node.keywords
                                for x in self.src.walk(arg))):
                return self.call_result(node.func.id)
            return self._builtin_call(node)
        if kind is ast.Compare and len(node.ops) == 1:
            op = COMPARE_OPS.get(type(node.ops[0]))
            right = node.comparators[0]
            if (op in ("in", "not in") and isinstance(node.left, ast.Constant) and isinstance(right, ast.Name)
                    and isinstance(right.ctx, ast.Load)):
                source = self.local_call(right)
                keys = self.returned_keys(source) if source else None
                if keys is not None:
                    return (node.left.value in keys) == (op == "in")
            a, b = self.value(node.left), self.value(node.comparators[0])
            if op in ("is", "is not") and (a is NOT_NONE and b is None or b is NOT_NONE and a is None):
                return op == "is not"
            if op and a is not UNKNOWN and b is not UNKNOWN and a is not NOT_NONE and b is not NOT_NONE \
                    and is_literal(a) and is_literal(b) and not (op in ("is", "is not") and None not in (a, b)):
                try:
                    return bool(EVALUATE[op](a, b))
                except TypeError:
                    return UNKNOWN
            return UNKNOWN
        if kind is ast.Compare:  # a chain, a < b < c: known when every operand is a known literal
            vals = [self.value(x) for x in (node.left, *node.comparators)]
            ops = [COMPARE_OPS.get(type(op)) for op in node.ops]
            if all(v is not UNKNOWN and v is not NOT_NONE and is_literal(v) for v in vals) \
                    and all(op in ("==", "!=", "<", "<=", ">", ">=") for op in ops):
                try:
                    return all(EVALUATE[op](a, b) for op, a, b in zip(ops, vals, vals[1:]))
                except TypeError:
                    return UNKNOWN
            return UNKNOWN
        if kind is ast.IfExp:
            t = self.value(node.test, cond=True)
            if t is UNKNOWN or t is NOT_NONE:
                return UNKNOWN
            return self.value(node.body if t else node.orelse, cond)
        return UNKNOWN

    def loads_anywhere_in(self, fn, name):
        """Whether `name` is loaded in fn or in a function nested in it."""
        if name in self.loads_in.get(fn, ()):
            return True
        nested = self.__dict__.setdefault("_nested", None)
        if nested is None:
            nested = self._nested = {}
            for node in self.ordered:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    outer = self.fn_of.get(node)
                    while outer is not None:
                        nested.setdefault(outer, []).append(node)
                        outer = self.fn_of.get(outer)
        return any(name in self.loads_in.get(inner, ()) for inner in nested.get(fn, ()))

    def _bound_in(self, fn, name):
        return name in self._store_counts(fn)

    def _boolop_value(self, node, cond):
        """(value, kept operands) of and/or: a known operand with no effect on the result goes; one that decides the
        whole ends it (the operands before it stay unless the whole is a condition and they call nothing)."""
        is_and, kept, last = isinstance(node.op, ast.And), [], node.values[-1]
        for operand in node.values:
            v = self.value(operand, cond)
            if v is UNKNOWN or v is NOT_NONE or not is_literal(v):
                kept.append(operand)
                continue
            if bool(v) == is_and:  # truthy in `and`, falsy in `or`: no effect but as the last operand
                if operand is not last:
                    continue
                if not kept:
                    return v, []
                if not cond:
                    kept.append(operand)
                continue  # `x and True` as a condition: x
            if not kept or (cond and not any(isinstance(x, ast.Call) for k in kept for x in self.src.walk(k))):
                return v, []
            kept.append(operand)
            return UNKNOWN, kept
        return UNKNOWN, kept

    # -- expression text with folding applied

    def replaceable(self, node, v):
        return v is not UNKNOWN and v is not NOT_NONE and is_literal(v) and not isinstance(node, (ast.Constant, ast.Tuple))

    def mark_hot(self):
        """The expressions folding may change (a known value, an and/or or conditional with a known part, a setting
        read) and every node above them: render copies the others' text as it is."""
        hot = set()
        for node in self.all_nodes:
            kind = _HOT_KINDS.get(node.__class__)
            if kind is None:
                kind = _HOT_KINDS[node.__class__] = _hot_kind(node)
            if kind is _SKIP or ((kind is _READ or kind is _STORED) and not isinstance(node.ctx, ast.Load)):
                continue  # a store or del: no setting_of, UNKNOWN (a List: NOT_NONE), nothing recorded
            # setting_of is None but for a Name or Attribute, predicate but for a Compare (neither records anything)
            known = (self.setting_of(node) is not None if kind is _READ else
                     self.predicate(node) is not None if kind is _COMPARE else False)
            if not known:
                v = self.value(node)
                known = v is not UNKNOWN and v is not NOT_NONE
            if not known and isinstance(node, (ast.BoolOp, ast.IfExp)):
                parts = node.values if isinstance(node, ast.BoolOp) else [node.test]
                known = any(self.value(p, cond=True) not in (UNKNOWN, NOT_NONE) for p in parts)
            if known:
                while node is not None and id(node) not in hot:
                    hot.add(id(node))
                    node = self.parents.get(node)
        self.hot = hot

    def render(self, node, cond=False):
        """The source text of expression `node` with what is known folded."""
        if id(node) not in self.hot:
            return self.src.segment(node)
        if isinstance(node, ast.expr) and not isinstance(node, (ast.JoinedStr,)):
            if isinstance(node, (ast.Name, ast.Attribute)) and not isinstance(node.ctx, ast.Load):
                return self.src.segment(node)
            v = self.value(node, cond)
            if self.replaceable(node, v) and (cond or not isinstance(node, (ast.BoolOp,)) or isinstance(v, bool)):
                if cond and not isinstance(v, bool):
                    v = bool(v) if not isinstance(node, (ast.Name, ast.Attribute)) else v
                return literal_text(v)
            if isinstance(node, ast.BoolOp):
                v, kept = self._boolop_value(node, cond)
                if not kept:  # decided by a known operand: its value (`h.a or h.b`, both known: h.b's)
                    return literal_text(v)
                if len(kept) != len(node.values):
                    word = " and " if isinstance(node.op, ast.And) else " or "
                    parts = [self._wrapped(k, cond) for k in kept]
                    return parts[0] if len(parts) == 1 else word.join(parts)
            if isinstance(node, ast.IfExp):
                t = self.value(node.test, cond=True)
                if t is not UNKNOWN and t is not NOT_NONE:
                    return self.render(node.body if t else node.orelse, cond)
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
                return self._splice(node, {node.operand: True})
        if isinstance(node, ast.JoinedStr):
            return self.src.segment(node)
        return self._splice(node, {})

    def _wrapped(self, node, cond):
        text = self.render(node, cond)
        if isinstance(node, (ast.BoolOp, ast.IfExp, ast.Lambda, ast.NamedExpr)):
            return f"({text})"
        return text

    def _splice(self, node, cond_children):
        """node's text with each child expression rendered (children in `cond_children` as conditions)."""
        a, b = self.src.span(node)
        pieces, pos = [], a
        for child in self._expr_children(node):
            ca, cb = self.src.span(child)
            if ca < pos or cb > b:
                continue
            cond = child in cond_children or (isinstance(node, ast.IfExp) and child is node.test) or \
                (isinstance(node, ast.comprehension) and child in node.ifs)
            text = self.render(child, cond)
            if text != self.src.text[ca:cb]:
                pieces.append(self.src.text[pos:ca])
                pieces.append(text)
                pos = cb
        pieces.append(self.src.text[pos:b])
        return "".join(pieces)

    def _expr_children(self, node):
        out = []
        for child in self.src.kids[node]:
            if isinstance(child, ast.expr):
                out.append(child)
            elif isinstance(child, (ast.keyword, ast.comprehension, ast.arguments, ast.arg, ast.Slice)):
                out.extend(self._expr_children(child))
            # operators, contexts: nothing
        return sorted((c for c in out if hasattr(c, "lineno")), key=lambda c: (c.lineno, c.col_offset))


_SKIP, _READ, _COMPARE, _STORED, _OTHER = "skip", "read", "compare", "stored", "other"  # mark_hot's kinds of node
_HOT_KINDS = {}  # node class -> its kind


def _hot_kind(node):
    """_SKIP: no expression, a Constant or one of _NEVER_KNOWN; _READ: a Name or Attribute (setting_of may know
    it, when loaded); _COMPARE: a Compare (predicate may); _STORED: a Subscript, Tuple or List (a target, when not
    loaded: so is a Name or Attribute); _OTHER: any other expression."""
    if not isinstance(node, ast.expr) or isinstance(node, ast.Constant) or node.__class__ in _NEVER_KNOWN:
        return _SKIP
    return _READ if isinstance(node, (ast.Name, ast.Attribute)) else _COMPARE if isinstance(node, ast.Compare) \
        else _STORED if isinstance(node, (ast.Subscript, ast.Tuple, ast.List)) else _OTHER


# ---------------------------------------------------------------------------------------------------- statements


class Folder:
    """One round of statement edits from an Analysis: known branches kept alone, dead statements dropped."""

    def __init__(self, analysis: Analysis):
        self.a = analysis
        self.src = analysis.src
        self.edits = []  # (start, end, text)
        self._guards = {}  # guard_call's answers by (function, name)

    def run(self):
        self.a.mark_hot()
        self.block(self.src.tree.body, None)
        return self.edits

    def edit(self, start, end, text):
        self.edits.append((start, end, text))

    def block(self, stmts, owner):
        """Edits for a block of statements; removes the block's dead tail."""
        removed = []
        for i, stmt in enumerate(stmts):
            if i > 0 and isinstance(stmts[i - 1], (ast.Return, ast.Raise, ast.Continue, ast.Break)):
                removed.extend(stmts[i:])
                break
            r = self.statement(stmt)
            if r == "removed":
                removed.append(stmt)
        if removed:
            first = stmt_first_line(removed[0])
            if len(removed) == len(stmts) and owner is not None:
                # the whole block goes: one `pass` in its place
                ind = " " * self.src.indent(stmts[0].lineno)
                if stmts[0].lineno == getattr(owner, "lineno", -1):  # `if x: y` on one line
                    a, _ = self.src.span(stmts[0])
                    _, b = self.src.span(stmts[-1])
                    self.edit(a, b, "pass")
                    return
                a = self.src.starts[self.src.comments_above(first) - 1]
                b = self.src.starts[removed[-1].end_lineno]
                self.edit(a, b, ind + "pass\n")
                return
            for stmt in removed:
                a = self.src.starts[self.src.comments_above(stmt_first_line(stmt)) - 1]
                b = self.src.starts[stmt.end_lineno]
                if stmt.lineno == getattr(owner, "lineno", -1):
                    continue
                self.edit(a, b, "")

    def statement(self, stmt):
        a = self.a
        if isinstance(stmt, ast.If):
            return self.if_statement(stmt)
        if isinstance(stmt, ast.While):
            t = a.value(stmt.test, cond=True)
            if t is False:
                return "removed"
            self.expression(stmt.test, cond=True)
            self.block(stmt.body, stmt)
            self.block(stmt.orelse, stmt) if stmt.orelse else None
            return None
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            self.block(stmt.body, stmt)
            return None
        if isinstance(stmt, (ast.For, ast.AsyncFor)):
            it = a.value(stmt.iter)
            if isinstance(it, (tuple, str)) and not it and not stmt.orelse:
                return "removed"  # a loop over nothing
            self.expression(stmt.iter)
            self.block(stmt.body, stmt)
            if stmt.orelse:
                self.block(stmt.orelse, stmt)
            return None
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                self.expression(item.context_expr)
            self.block(stmt.body, stmt)
            return None
        if isinstance(stmt, ast.Try):
            self.block(stmt.body, stmt)
            for handler in stmt.handlers:
                self.block(handler.body, handler)
            for part in (stmt.orelse, stmt.finalbody):
                if part:
                    self.block(part, stmt)
            return None
        if isinstance(stmt, ast.Assign) and self.dead_local(stmt):
            return "removed"
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            return None  # a docstring
        if isinstance(stmt, ast.Expr) and self.guard_call(stmt.value):
            ok = a.value(stmt.value.args[0], cond=True)
            if ok is not UNKNOWN and ok is not NOT_NONE and ok:
                return "removed"  # a check that always passes
            self.expression(stmt.value.args[0], cond=True)
            for arg in stmt.value.args[1:]:
                self.expression(arg)
            return None
        for child in self.src.kids[stmt]:
            if isinstance(child, ast.expr) and not (isinstance(child, (ast.Name, ast.Attribute, ast.Subscript,
                                                                         ast.Tuple, ast.List))
                                                    and not isinstance(getattr(child, "ctx", ast.Load()), ast.Load)):
                self.expression(child, cond=isinstance(stmt, ast.Assert) and child is stmt.test)
        return None

    def guard_call(self, call):
        """A call of a check: a function whose body is `if not FIRST_PARAM: raise ...` (its first argument is a
        condition; the call does nothing when it holds)."""
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.args and not call.keywords
                and not any(isinstance(x, ast.Starred) for x in call.args)):
            return False
        fn = self.a.fn_of.get(call)
        key = (fn, call.func.id)  # the answer is the function's (scope, name)'s: looked up once a round
        if key not in self._guards:
            self._guards[key] = self._guard_function(fn, call.func.id)
        return self._guards[key]

    def _guard_function(self, fn, name):
        scopes = [fn.body] if fn is not None else []
        scopes.append(self.src.tree.body)
        for body in scopes:
            for d in body:
                if isinstance(d, ast.FunctionDef) and d.name == name:
                    inner = past_docstring(d)
                    return (len(inner) == 1 and isinstance(inner[0], ast.If) and not inner[0].orelse
                            and d.args.args and isinstance(inner[0].test, ast.UnaryOp)
                            and isinstance(inner[0].test.op, ast.Not) and isinstance(inner[0].test.operand, ast.Name)
                            and inner[0].test.operand.id == d.args.args[0].arg
                            and all(isinstance(x, ast.Raise) for x in inner[0].body))
        return False

    def dead_local(self, stmt):
        """A local set to a literal that nothing reads (its reads were folded)."""
        if len(stmt.targets) != 1 or not isinstance(stmt.targets[0], ast.Name):
            return False
        fn = self.a.fn_of.get(stmt)
        if fn is None or self.a.parents.get(stmt) is not fn:
            return False
        name = stmt.targets[0].id
        if name not in self.a.local_consts(fn) and name not in self.a.local_aliases(fn):
            return False
        return not self.a.loads_anywhere_in(fn, name)

    def expression(self, node, cond=False):
        if id(node) not in self.a.hot:
            return  # render gives its text as it is: no edit
        text = self.a.render(node, cond)
        seg = self.src.segment(node)
        if text != seg:
            a, b = self.src.span(node)
            self.edit(a, b, text)

    def else_line(self, stmt):
        """The line of `else:` between an if's body and its else block."""
        ind = self.src.indent(stmt.lineno)
        for n in range(stmt.body[-1].end_lineno + 1, stmt.orelse[0].lineno):
            line = self.src.lines[n - 1]
            if line.strip().startswith("else") and self.src.indent(n) == ind and n not in self.src.string_lines:
                return n
        raise SpecialiseError(f"line {stmt.lineno}: no else line found")

    def is_elif(self, stmt):
        return self.src.lines[stmt.lineno - 1][self.src.offset(stmt.lineno, stmt.col_offset)
                                                - self.src.starts[stmt.lineno - 1]:].startswith("elif")

    def if_statement(self, stmt):
        src = self.src
        t = self.a.value(stmt.test, cond=True)
        if t is UNKNOWN or t is NOT_NONE:
            self.expression(stmt.test, cond=True)
            self.block(stmt.body, stmt)
            if stmt.orelse and not (len(stmt.orelse) == 1 and isinstance(stmt.orelse[0], ast.If)
                                    and self.is_elif(stmt.orelse[0])):
                self.block(stmt.orelse, stmt)
            elif stmt.orelse:
                self.if_statement(stmt.orelse[0])
            return None
        ind = src.indent(stmt.lineno)
        header_last = stmt.body[0].lineno - 1 if stmt.body[0].lineno > stmt.lineno else stmt.lineno
        one_line = stmt.body[0].lineno == stmt.lineno
        has_elif = bool(stmt.orelse) and len(stmt.orelse) == 1 and isinstance(stmt.orelse[0], ast.If) \
            and self.is_elif(stmt.orelse[0])
        start = src.starts[stmt.lineno - 1]
        end = src.starts[stmt.end_lineno]
        if self.is_elif(stmt):
            # inside a chain: rewrite the chain's text from this `elif` on
            if t:
                if one_line:
                    a, _ = src.span(stmt.body[0])
                    _, b = src.span(stmt.body[-1])
                    self.edit(start, end, " " * ind + "else: " + src.text[a:b] + "\n")
                else:
                    self.edit(start, src.starts[stmt.body[-1].end_lineno],
                              " " * ind + "else:\n" + src.text[src.starts[header_last]:src.starts[stmt.body[-1].end_lineno]])
                    self.edit(src.starts[stmt.body[-1].end_lineno], end, "")
            elif not stmt.orelse:
                self.edit(start, end, "")
            elif has_elif:
                nxt = stmt.orelse[0]
                self.edit(start, src.starts[nxt.lineno - 1], "")
            else:
                self.edit(start, src.starts[self.else_line(stmt) - 1], "")
            return None
        if t:
            if one_line:
                a, _ = src.span(stmt.body[0])
                _, b = src.span(stmt.body[-1])
                text = " " * ind + src.text[a:b] + "\n"
                if stmt.orelse:
                    self.edit(start, end, text)
                else:
                    self.edit(start, src.starts[stmt.lineno], text)
                return None
            first = src.comments_above(stmt_first_line(stmt))
            body = src.dedented(header_last + 1, stmt.body[-1].end_lineno, src.indent(stmt.body[0].lineno) - ind)
            self.edit(src.starts[first - 1] if first < stmt.lineno else start, end, body)
            return None
        if not stmt.orelse:
            return "removed"
        if has_elif:
            nxt = stmt.orelse[0]
            a = src.offset(nxt.lineno, nxt.col_offset)
            self.edit(start, a + 2, " " * ind)  # `elif` -> `if`, at the if's place
            return None
        el = self.else_line(stmt)
        first_body = stmt.orelse[0]
        if first_body.lineno == el:  # `else: x` on one line
            a, _ = src.span(first_body)
            _, b = src.span(stmt.orelse[-1])
            self.edit(start, end, " " * ind + src.text[a:b] + "\n")
            return None
        body = src.dedented(el + 1, stmt.orelse[-1].end_lineno, src.indent(first_body.lineno) - ind)
        self.edit(start, end, body)
        return None


def apply_edits(text, edits):
    """Apply non-overlapping edits; an edit inside another is dropped (the outer one wins; the inner one comes back
    next round if it still applies)."""
    edits = sorted(set(edits), key=lambda e: (e[0], -e[1]))
    kept, last_end = [], -1
    for e in edits:
        if e[0] < last_end or (kept and e[0] == kept[-1][0] and e[1] <= kept[-1][1] and e != kept[-1]):
            continue
        kept.append(e)
        last_end = max(last_end, e[1])
    pieces, pos = [], 0  # kept: in order, none starting before the one before it ends (as cut back to front)
    for a, b, t in kept:
        pieces += (text[pos:a], t)
        pos = b
    pieces.append(text[pos:])
    return "".join(pieces), len(kept)


# ---------------------------------------------------------------------------------------------------- definitions


def names_in(node, lazy_annotations=True, kids=None):
    """Names loaded and attribute names read anywhere in node, and the strings it holds; with
    `from __future__ import annotations` (lazy_annotations) annotations are strings nothing evaluates: not read.
    `kids`: Source.kids of node's tree (its child lists, made once), or None."""
    names, attrs, strings = set(), set(), set()
    todo = [node]
    while todo:
        n = todo.pop()
        kind = n.__class__  # a tree of ast.parse's: isinstance of a leaf class is `is`
        if kind is ast.Name:
            names.add(n.id)
            continue  # no child but its context
        if kind is ast.Constant:
            if isinstance(n.value, str):
                strings.add(n.value)
            continue
        if kind is ast.Attribute:
            attrs.add(n.attr)
        children = kids[n] if kids is not None else child_nodes(n)
        if lazy_annotations:  # the annotation fields of a parameter, an annotated assignment or a function
            skip = n.annotation if kind is ast.AnnAssign or kind is ast.arg else \
                n.returns if kind is ast.FunctionDef or kind is ast.AsyncFunctionDef else None
            if skip is not None:
                children = [c for c in children if c is not skip]
        todo.extend(children)
    return names, attrs, strings


def dead_definitions(src: Source, memo=None):
    """Spans of module-level definitions, methods and settings that no kept code reaches. `memo`: names_in's results
    by the text of the node (a dict kept from round to round: most definitions come back unchanged)."""
    tree = src.tree
    defs = {}  # name -> [stmt]
    roots = []
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs.setdefault(stmt.name, []).append(stmt)
        elif (isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets)) or \
                (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for t in targets:
                defs.setdefault(t.id, []).append(stmt)
        else:
            roots.append(stmt)
    lazy = any(isinstance(s, ast.ImportFrom) and s.module == "__future__" and any(a.name == "annotations" for a in s.names)
               for s in tree.body)
    live_names, live_attrs, live_strings = set(), set(), set()
    live_defs, methods_seen = set(), set()
    pending = list(roots)
    kids = src.kids

    def names(node):
        """names_in(node, lazy): a function of the node's text (its decorators' included), which parses to it."""
        if memo is None:
            return names_in(node, lazy, kids)
        first = node.decorator_list[0] if getattr(node, "decorator_list", None) else node
        key = (src.text[src.offset(first.lineno, first.col_offset):src.offset(node.end_lineno, node.end_col_offset)],
               lazy)
        found = memo.get(key)
        if found is None:
            found = memo[key] = names_in(node, lazy, kids)
        return found

    def scan(node, skip_methods=False):
        if isinstance(node, ast.ClassDef) and skip_methods:
            n, a, s = set(), set(), set()
            for part in node.bases + node.keywords + node.decorator_list:
                x = names(part)
                n |= x[0]; a |= x[1]; s |= x[2]
            for stmt in node.body:
                if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    x = names(stmt)
                    n |= x[0]; a |= x[1]; s |= x[2]
            return n, a, s
        return names(node)

    changed = True
    while changed:
        changed = False
        while pending:
            node = pending.pop()
            n, a, s = scan(node, skip_methods=isinstance(node, ast.ClassDef))
            new_names = n - live_names
            live_names |= n
            live_attrs |= a
            live_strings |= s
            for name in new_names:
                for d in defs.get(name, ()):
                    if id(d) not in live_defs:
                        live_defs.add(id(d))
                        pending.append(d)
        # methods of live classes whose names are read
        for name, ds in defs.items():
            for d in ds:
                if isinstance(d, ast.ClassDef) and id(d) in live_defs:
                    for m in d.body:
                        if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and id(m) not in methods_seen \
                                and method_live(m, live_attrs, live_strings):
                            methods_seen.add(id(m))
                            pending.append(m)
                            changed = True
    dead = []
    for name, ds in defs.items():
        for d in ds:
            if id(d) not in live_defs and d not in dead and name not in KEEP_NAMES:
                dead.append(d)
    dead_methods = []
    for name, ds in defs.items():
        for d in ds:
            if isinstance(d, ast.ClassDef) and id(d) in live_defs:
                methods = [m for m in d.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
                for m in methods:
                    if id(m) not in methods_seen:
                        dead_methods.append((d, m))
    return dead, dead_methods


def dead_attribute_stores(src: Source):
    """`self.a = LITERAL` statements (a switched-off piece's `self.piece = None`) whose attribute nothing in the file
    reads and no string names (a word of any string constant: getattr(m, "a") reads it)."""
    read = {n.attr for n in src.of_type(ast.Attribute) if isinstance(n.ctx, ast.Load)}
    words = set()
    for n in src.of_type(ast.Constant):
        if isinstance(n.value, str):
            words.update(n.value.replace(".", " ").replace(",", " ").split())
    return [stmt for stmt in src.of_type(ast.Assign)
            if len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Attribute)
            and isinstance(stmt.targets[0].value, ast.Name) and stmt.targets[0].value.id == "self"
            and isinstance(stmt.value, ast.Constant) and stmt.targets[0].attr not in read | words]


def write_only_calls(src: Source):
    """The statements `NAME.method(...)` of a write-only object: a module global NAME = Class() that nothing else in
    the file reads, whose called methods change only the object (every call in them on an attribute of self, every
    store to self's attributes or a local, no global or nonlocal) and whose arguments call nothing. Nothing can see
    what they do (CONTEXT when no piece reads it): they go, and the object and its class with them."""
    classes = {n.name: n for n in src.tree.body if isinstance(n, ast.ClassDef)}
    objects = {}
    for stmt in src.tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name) \
                and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Name) \
                and stmt.value.func.id in classes and not stmt.value.args and not stmt.value.keywords:
            objects[stmt.targets[0].id] = (stmt, classes[stmt.value.func.id])
    calls = {name: [] for name in objects}
    parents = {kid: node for node, kids in src.kids.items() for kid in kids} if objects else {}
    for node in src.of_type(ast.Name):
        if node.id not in objects or node is objects[node.id][0].targets[0]:
            continue
        parent = parents.get(node)
        call = parents.get(parent) if isinstance(parent, ast.Attribute) else None
        stmt = parents.get(call) if isinstance(call, ast.Call) and call.func is parent else None
        if not isinstance(stmt, ast.Expr) or any(isinstance(x, (ast.Call, ast.Await, ast.Yield, ast.YieldFrom,
                                                                  ast.NamedExpr)) for a in call.args + call.keywords
                                                 for x in src.walk(a)):
            calls.pop(node.id, None)  # read otherwise (or the name of something else): not write-only
            continue
        if node.id in calls:
            calls[node.id].append((stmt, parent.attr))

    def rooted_at_self(n):
        while isinstance(n, (ast.Attribute, ast.Subscript, ast.Call)):
            n = n.func if isinstance(n, ast.Call) else n.value
        return isinstance(n, ast.Name) and n.id == "self"

    def changes_only_self(fn):
        for n in src.walk(fn):
            if isinstance(n, (ast.Global, ast.Nonlocal, ast.Delete)) or (
                    isinstance(n, ast.Call) and not rooted_at_self(n.func)) or (
                    isinstance(n, (ast.Attribute, ast.Subscript)) and isinstance(n.ctx, ast.Store)
                    and not rooted_at_self(n)):
                return False
        return True
    out = []
    for name, found in calls.items():
        methods = {m.name: m for m in objects[name][1].body if isinstance(m, ast.FunctionDef)}
        if all(attr in methods and changes_only_self(methods[attr]) for _, attr in found):
            out += [stmt for stmt, _ in found]
    return out


def squeeze_blank_lines(text):
    """Runs of more than two blank lines (left where definitions went) cut to two, outside multi-line strings."""
    src, out, blank = Source(text), [], 0
    for i, line in enumerate(src.lines, 1):
        blank = blank + 1 if not line.strip() and i not in src.string_lines else 0
        if blank <= 2:
            out.append(line)
    return "".join(out)


def method_live(m, attrs, strings):
    name = m.name
    if name.startswith("__") and name.endswith("__"):
        return True
    if name in HOOK_METHODS:
        return True
    return name in attrs or name in strings


def dead_settings(src: Source, table, fixed_names, machine):
    """Statements of Hyperparameters.__init__ and _validate that set, or check, only attributes nothing else reads
    (a setting's read, a value derived from settings, a check naming one). Fixed settings (the refusal reads them),
    the machine's and PRESET stay."""
    tree = src.tree
    hp = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Hyperparameters"), None)
    if hp is None:
        return []
    own_fns = [f for f in hp.body if isinstance(f, ast.FunctionDef) and f.name in ("__init__", "_validate")]
    own = {id(x) for f in own_fns for x in src.walk(f)}
    stored = set()
    for f in own_fns:
        for node in src.walk(f):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
                    and node.value.id == "self"):
                stored.add(node.attr)
    read_elsewhere = {node.attr for node in src.of_type(ast.Attribute)
                      if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and id(node) not in own}
    keep = {attr for attr, (name, _) in table.items() if name in fixed_names or name in machine or name == "PRESET"}
    dead = stored - read_elsewhere - keep - {"settings", "effective", "_environ", "_preset", "real"}

    memo_stores, memo_mentions = {}, {}  # node -> its set: each is asked again after every _Again

    def stores(stmt):
        if stmt not in memo_stores:
            memo_stores[stmt] = {t.attr for t in src.walk(stmt)
                                 if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store)}
        return memo_stores[stmt]

    def mentions(node):
        if node not in memo_mentions:
            memo_mentions[node] = {n.attr for n in src.walk(node)
                                   if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)}
        return memo_mentions[node]

    def removable(stmt):
        if isinstance(stmt, (ast.Assign, ast.AugAssign)):
            st = stores(stmt)
            return bool(st) and st <= dead
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Name) \
                and stmt.value.func.id == "need":
            return bool(mentions(stmt.value) & dead)
        if isinstance(stmt, ast.If):
            return bool(mentions(stmt.test) & dead) and stores(stmt) <= dead
        return False

    def visit(body, out):
        for stmt in body:
            if removable(stmt):
                out.append(stmt)
                continue
            for child in src.kids[stmt]:
                if isinstance(child, ast.expr):
                    live = mentions(child) & dead
                    if live:
                        dead.difference_update(live)
                        raise _Again
            for field_name in ("body", "orelse", "finalbody"):
                inner = getattr(stmt, field_name, None)
                if isinstance(inner, list) and not isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):
                    visit(inner, out)
                for handler in getattr(stmt, "handlers", []) if field_name == "body" else []:
                    visit(handler.body, out)

    while True:
        out = []
        try:
            for f in own_fns:
                visit(f.body, out)
        except _Again:
            continue
        return out


class _Again(Exception):
    """dead_settings: an attribute turned out to be read; start over."""


def drop_unread_fixed(src: Source, table, values):
    """The reads (`self.X = self._env(...)`) of fixed settings ({NAME: the run's value}) that no code reads any more
    go: the specialised file checks them in the environment instead, parsed as their run's value's type
    (Hyperparameters._check_specialised); so only those whose value is of their kind (bool, int, str, float). Returns
    the new source."""
    hp = next((n for n in src.tree.body if isinstance(n, ast.ClassDef) and n.name == "Hyperparameters"), None)
    init = next(f for f in hp.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    kinds = {"bool": bool, "int": int, "str": str, "float": float}
    fixed = {attr for attr, (name, kind) in table.items() if name in values and name != "PRESET"
             and kind in kinds and type(values[name]) is kinds[kind]}
    read = {node.attr for node in src.of_type(ast.Attribute) if isinstance(node.ctx, ast.Load)}
    gone = [stmt for stmt in init.body
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Attribute)
            and stmt.targets[0].attr in fixed - read and isinstance(stmt.value, ast.Call)
            and isinstance(stmt.value.func, ast.Attribute) and stmt.value.func.attr == "_env"]
    return Source(apply_edits(src.text, removal_edits(src, gone))[0]) if gone else src


def removal_edits(src: Source, stmts):
    """Edits removing whole statements (with their comments and decorators); a block left empty gets `pass`."""
    gone = {id(s) for s in stmts}
    edits = []
    for stmt in stmts:
        owner, fname = src.owners.get(id(stmt), (None, None))
        a = src.starts[src.comments_above(stmt_first_line(stmt)) - 1]
        b = src.starts[stmt.end_lineno]
        text = ""
        if owner is not None and not isinstance(owner, ast.Module):
            siblings = getattr(owner, fname)
            if all(id(s) in gone for s in siblings) and stmt is siblings[0]:
                text = " " * src.indent(stmt.lineno) + "pass\n"
        edits.append((a, b, text))
    return edits


# ---------------------------------------------------------------------------------------------------- presets


def preset_edits(src: Source, run_preset, values):
    """PRESETS replaced by the run's one preset (its values with the VAR=VALUE given); PRESET's default its name."""
    edits, first = [], True
    for stmt in src.tree.body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else []
        if any((isinstance(t, ast.Name) and t.id == "PRESETS") or
               (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == "PRESETS")
               for t in targets):
            a = src.starts[stmt.lineno - 1]
            b = src.starts[stmt.end_lineno]
            if first:
                body = ",\n".join(f"    {k!r}: {v!r}" for k, v in values.items())
                edits.append((a, b, f"PRESETS = {{{run_preset!r}: {{\n{body},\n}}}}\n" if values else
                              f"PRESETS = {{{run_preset!r}: {{}}}}\n"))
                first = False
            else:
                start = src.starts[src.comments_above(stmt.lineno) - 1]
                edits.append((start, b, ""))
    for node in src.nodes:
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "_env"
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "PRESET"):
            a, b = src.span(node.args[1])
            edits.append((a, b, repr(run_preset)))
    return edits


def specialised_edit(src: Source, record):
    for stmt in src.tree.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "SPECIALISED" for t in stmt.targets):
            a, b = src.span(stmt.value)
            return [(a, b, record)]
    raise SpecialiseError("the source has no SPECIALISED = {} line to record the specialisation in")


# ---------------------------------------------------------------------------------------------------- driver


def recorded(text):
    """The SPECIALISED record of a source ({} for the full script, None where there is none or it is not a literal):
    read from its text, nothing executed."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "SPECIALISED" for t in stmt.targets):
            try:
                value = ast.literal_eval(stmt.value)
            except ValueError:
                return None
            return value if isinstance(value, dict) else None
    return None


def same_specialisation(full_text, readable_text, path="train_gpt.py"):
    """(ok, message): whether `readable_text` is `full_text` specialised to the run it records."""
    record = recorded(readable_text)
    if not record:
        return False, "it records no specialisation (SPECIALISED is empty or missing): not a specialised file"
    sha = hashlib.sha256(full_text.encode()).hexdigest()
    if record.get("source_sha256") != sha:
        return False, (f"it was specialised from a script with sha256 {record.get('source_sha256')}, not {path} "
                       f"(sha256 {sha})")
    try:
        again = specialise(full_text, dict(record["run"]), path).text
    except SpecialiseError as e:
        return False, f"{path} cannot be specialised to its run: {e}"
    if again != readable_text:
        return False, f"it differs from {path} specialised to {' '.join(f'{k}={v}' for k, v in record['run'].items())}"
    return True, f"{path} (sha256 {sha[:12]}...) specialised to {' '.join(f'{k}={v}' for k, v in record['run'].items())}"


def parse_run(items):
    run = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name or not name.replace("_", "").isalnum() or not name.isupper():
            raise SpecialiseError(f"{item!r} must be VAR=VALUE with VAR an upper-case setting name")
        run[name] = value
    run.setdefault("PRESET", "record_0323")
    return run


def run_from_environ(text, environ):
    """The run an environment describes: PRESET and every other setting of `text` set in it, but the machine's
    (MACHINE_SETTINGS) and those naming one run's files (RUN_ID, SEED stay settings of the file)."""
    table, machine = settings_table(ast.parse(text))
    names = {name for name, _ in table.values()} - set(machine) - {"RUN_ID", "SEED"}
    run = {name: environ[name] for name in sorted(names) if environ.get(name, "").strip()}
    run.setdefault("PRESET", "record_0323")
    return run


_RESULTS = {}  # (source sha256, run, the analysis) -> Specialised: one process specialises a run once
_MODULES = {}  # source sha256 -> its loaded module


def specialise(text, run, path="train_gpt.py", max_rounds=60):
    """The source `text` specialised to the run (a dict: PRESET and VAR=VALUE strings)."""
    sha = hashlib.sha256(text.encode()).hexdigest()
    run = {"PRESET": run.get("PRESET", "record_0323"), **{k: v for k, v in run.items() if k != "PRESET"}}
    key = (sha, tuple(run.items()), Analysis.__init__, Folder.run)
    if key not in _RESULTS:
        with gc_paused():
            _RESULTS[key] = _specialise(text, run, path, max_rounds, sha)
    return _RESULTS[key]


@contextlib.contextmanager
def gc_paused():
    """The cyclic garbage collector off for a while (as it was after): each round parses the source again, some 70,000
    new nodes whose allocation set off collections of the whole heap (a test process's, torch's included) that freed
    nothing (an AST holds no cycle) and took a third of the time. Reference counting frees as before."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _specialise(text, run, path, max_rounds, sha):
    src = Source(text)
    table, machine = settings_table(src.tree)
    if not table:
        raise SpecialiseError(f"{path}: no Hyperparameters settings found: not a train_gpt.py")
    names = {name: attr for attr, (name, _) in table.items()}
    for name in run:
        if name not in names:
            raise SpecialiseError(f"{name} is not a setting of {path} (python3 train_gpt.py --help lists them)")
        if name in machine:
            raise SpecialiseError(f"{name} describes the machine, not the run: it stays open in a specialised file")
    if sha not in _MODULES:
        _MODULES[sha] = load_module(text, path)
    module = _MODULES[sha]
    h = run_settings(module, run)
    preset = dict(module.PRESETS[h.preset])
    values = {**preset, **{k: v for k, v in run.items() if k != "PRESET"}}
    conditions = {}
    rounds = 0
    names_memo = {}  # dead_definitions' names_in by text, over the rounds
    for rounds in range(1, max_rounds + 1):
        analysis = Analysis(src, table, machine, h, conditions)
        edits = Folder(analysis).run()  # first: it records the conditions the removals below rely on
        dead, dead_methods = dead_definitions(src, names_memo)
        stmts = dead + [m for _, m in dead_methods] + dead_settings(src, table, set(conditions), machine) + \
            dead_attribute_stores(src) + write_only_calls(src)
        edits += removal_edits(src, stmts)  # a removal wins over a fold inside it (apply_edits)
        if not edits:
            break
        new_text, n = apply_edits(src.text, edits)
        if os.environ.get("SPECIALISE_TRACE"):
            print(f"round {rounds}: {n} edits, {len(new_text.splitlines())} lines", file=sys.stderr)
        try:
            src = Source(new_text)
        except SyntaxError as e:
            raise SpecialiseError(f"round {rounds}: the edits broke the source at line {e.lineno}: {e.msg}") from None
    else:
        raise SpecialiseError(f"no fixed point after {max_rounds} rounds")
    conds = {name: sorted(((op, lit, res) for (op, lit), res in c.items()), key=repr)
             for name, c in sorted(conditions.items())}
    by_name = {name: attr for attr, (name, _) in table.items()}
    fixed = {k: run_value(h, by_name[k], table[by_name[k]]) for k in conds}
    src = drop_unread_fixed(src, table, fixed)
    # a setting folded to its value outright (a bool, or one recorded equal to a literal: every read became it) is
    # checked for that value alone; the others' conditions are recorded
    outright = {k for k, c in conds.items()
                if table[by_name[k]][1] == "bool" or any(op == "==" and res for op, _, res in c)}
    record = repr({"source_sha256": sha, "run": run, "values": fixed,
                   "conditions": {k: c for k, c in conds.items() if k not in outright}})
    read = {n.args[0].value for n in src.of_type(ast.Call) if isinstance(n.func, ast.Attribute)
            and n.func.attr in ("_env", "_env_int_list") and n.args and isinstance(n.args[0], ast.Constant)}
    values = {k: v for k, v in values.items() if k in read}  # the preset's values of settings the file still reads
    text_out, _ = apply_edits(src.text, preset_edits(src, h.preset, values) + specialised_edit(src, record))
    text_out = squeeze_blank_lines(text_out)
    check_source(text_out)
    return Specialised(text_out, sha, run, conds, rounds)


def check_source(text):
    try:
        # compiled from the tree the check parsed (the same tree Python's own parse of the text gives: a Python 3.10
        # parse only refuses more), not parsed again
        compile(ast.parse(text, feature_version=MIN_PYTHON), "<specialised>", "exec")
    except SyntaxError as e:
        raise SpecialiseError(f"the specialised source does not compile: line {e.lineno}: {e.msg}") from None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", nargs="+", help="PRESET=NAME and VAR=VALUE settings of the run")
    p.add_argument("--source", default=str(REPO / "train_gpt.py"))
    p.add_argument("-o", "--out")
    args = p.parse_args(argv)
    try:
        text = Path(args.source).read_text(encoding="utf-8")
        spec = specialise(text, parse_run(args.run), args.source)
    except (SpecialiseError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(spec.text, encoding="utf-8")
    else:
        sys.stdout.write(spec.text)
    print(f"specialised {args.source} ({len(text.splitlines())} lines) to {len(spec.text.splitlines())} lines in "
          f"{spec.rounds} rounds; {len(spec.conditions)} settings fixed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
