"""JSON schema to GBNF: what structured outputs (response_format json_schema, tool calls)
hold the model to.

llama-cpp-python's converter, with llama.cpp's rules where the two differ in what reaches
the answer (llama-server runs llama.cpp's), and a translation of `pattern` of our own that
is right where both are wrong. Runs once per structured request, before decoding.
"""

from __future__ import annotations

import functools
import json
import math
import re
from decimal import Decimal
from re import _constants as C
from re import _parser as P

from workers.engine import errors
from workers.engine.errors import EngineError

#: The characters a JSON string holds only escaped: control characters, a quote, a backslash,
#: and DEL, which llama.cpp's converter escapes too.
_ESCAPED_ONLY = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F))
#: A JSON string's character in GBNF, as llama.cpp's converter writes it: any but those raw,
#: or an escape sequence; unlike llama.cpp's, a character beyond U+FFFF written as a pair of
#: \u escapes is one character (minLength and maxLength count it once, as JSON Schema
#: does), and a lone surrogate's escape, which decodes to no character, is refused.
_NOT_RAW = r'"\\\x7F\x00-\x1F'
_ESCAPED = (
    r'"\\" (["\\/bfnrt] | "u" ([0-9a-cA-Ce-fE-F] [0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2}'
    r' | [dD] [89abAB] [0-9a-fA-F]{2} "\\u" [dD] [c-fC-F] [0-9a-fA-F]{2}))'
)


@functools.lru_cache(maxsize=64)
def grammar_for_schema(schema_json: str) -> str:
    """GBNF for a JSON schema (see _schema_converter); EngineError INVALID_SCHEMA naming what
    it could not express. Kept for the last schemas seen: it is made in the engine's loop,
    and an application sends the same schema with every request."""
    try:
        converter = _schema_converter()(
            prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False
        )
        converter.visit(converter.resolve_refs(json.loads(schema_json), "stdin"), "")
        return converter.format_grammar()
    except Exception as exc:  # the converter raises ValueError, KeyError, NotImplementedError
        raise EngineError(
            errors.INVALID_SCHEMA, f"the JSON schema cannot be expressed as a grammar: {exc}"
        ) from None


@functools.cache
def _schema_converter():
    """llama-cpp-python's JSON-schema converter, changed where it lets through what is not
    the schema's JSON:

    - a string's character excludes control characters and DEL, which JSON forbids raw
      (llama-cpp-python's allowed a raw newline, and a stream moved to another replica once
      wrote one, which a JSON parser then refused);
    - a literal (an enum or const value, a property name: JSON text) escapes backslashes,
      so a quote, a backslash or an escaped newline in it is written as JSON, not cut
      short or turned into a raw newline;
    - and keeps non-ASCII characters as they are: json.dumps escapes them, which would
      make the model spell "é" as a \\u escape;
    - an object's additional properties (additionalProperties true or a schema) take any
      key but a declared one, so a declared property cannot come twice, the second time
      with a value its schema does not allow (see _not_names);
    - a string's `pattern` is translated by pattern_rule (both converters broke quotes,
      escapes and alternatives; see there), with its minLength and maxLength (both
      converters dropped them beside a pattern);
    - an integer's minimum and maximum (exclusive or not) bound it, as llama.cpp's do
      (llama-cpp-python's ignored them: a rating of 1 to 5 could come out as 7);
    - so do a number's (a confidence from 0 to 1, a price above 0.25), which neither
      converter does; a bounded number has no exponent."""
    from llama_cpp import llama_grammar as G

    escape = {"\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}
    char = G.BuiltinRule(f"[^{_NOT_RAW}] | {_ESCAPED}", [])
    # json.dumps's \u escapes, a surrogate pair as one; an escaped backslash is matched
    # first so that the "u" after it is left alone
    u_escape = re.compile(r"\\\\|\\u(d[89ab][0-9a-f]{2}\\ud[c-f][0-9a-f]{2}|[0-9a-f]{4})")

    def as_is(m):
        code = m.group(1)
        if (
            code is None
            or len(code) == 4
            and (int(code, 16) < 0x80 or 0xD800 <= int(code, 16) < 0xE000)
        ):
            return m.group(0)  # a control character (or a lone surrogate) stays escaped
        return json.loads(f'"\\u{code}"')

    class Converter(G.SchemaConverter):
        def __init__(self, **kwargs):
            self._declared: list[list[str]] = []  # the property names of objects being built
            super().__init__(**kwargs)

        def _format_literal(self, literal):
            literal = u_escape.sub(as_is, literal)
            return '"' + re.sub(r'[\r\n"\\]', lambda m: escape[m.group(0)], literal) + '"'

        def _add_primitive(self, name, rule):
            return super()._add_primitive(name, char if name == "char" else rule)

        def _build_object_rule(self, properties, required, name, additional_properties):
            # The rule for additional keys is added after the properties' own rules, nested
            # objects included, so the top of the stack is this object's names then.
            self._declared.append([k for k, _ in properties])
            try:
                return super()._build_object_rule(properties, required, name, additional_properties)
            finally:
                self._declared.pop()

        def _add_rule(self, name, rule):
            if self._declared and self._declared[-1] and rule.startswith('string ":" space '):
                names = _not_names(self._declared[-1], self._add_primitive("char", char))
                rule = super()._add_rule(f"{name}-key", names) + rule[len("string") :]
            return super()._add_rule(name, rule)

        def _visit_pattern(self, pattern, name):
            rule = pattern_rule(pattern, self._add_primitive("char", char), *self._lengths)
            return self._add_rule(name, rule)

        def visit(self, schema, name):
            rule = None
            # The base converter passes _visit_pattern the pattern alone.
            patterned = isinstance(schema, dict) and "pattern" in schema
            self._lengths = string_lengths(schema) if patterned else (0, None)
            if isinstance(schema, dict) and (bounds := integer_bounds(schema)) is not None:
                rule = integer_rule(*bounds)
            elif isinstance(schema, dict) and (bounds := number_bounds(schema)) is not None:
                rule = number_rule(*bounds)
            if rule is None:
                return super().visit(schema, name)
            rule_name = name + "-" if name in G.RESERVED_NAMES else name or "root"
            return self._add_rule(rule_name, f"({rule}) space")

    return Converter


def _not_names(names: list[str], char: str) -> str:
    """GBNF for a JSON string that is none of `names`, the way llama.cpp's _not_strings
    writes one (a trie of the names), and also right where a name is the start of another
    (llama.cpp's lets "a" through when "ab" is declared too). Names holding a quote, a
    backslash or a control character are left out (their JSON text has escapes), and a key
    spelling a name with \\u escapes is not caught: a model writes keys as they are."""
    end = object()
    trie: dict = {}
    for n in names:
        if any(c in '"\\' or ord(c) < 0x20 or c == "\x7f" for c in n):
            continue
        node = trie
        for c in n:
            node = node.setdefault(c, {})
        node[end] = True

    def esc(c: str) -> str:  # inside a character class (llama.cpp knows no "\\^")
        return {"]": "\\]", "-": "\\-", "^": "\\x5E"}.get(c, c)

    def rest(node: dict) -> str:
        kids = sorted(c for c in node if c is not end)
        other = f"[^{_NOT_RAW}{''.join(map(esc, kids))}] {char}* | {_ESCAPED} {char}*"
        body = " | ".join([*(f"[{esc(c)}] {rest(node[c])}" for c in kids), other])
        return f"({body})" if end in node else f"({body})?"

    return f'"\\"" {rest(trie)} "\\"" space'


# ---- integer bounds ------------------------------------------------------------------------

#: Digits of an integer with no bound on that side (the converters' integer rule allows 16).
MAX_DIGITS = 16


def _bounds(schema: dict, kind: str) -> tuple[list, list] | None:
    """The lower and upper bounds of a `kind` schema, each (value, exclusive), or None when
    it is another schema or has none. Both drafts' exclusive bounds count: draft 4's
    booleans beside minimum/maximum, and later drafts' numbers."""
    if schema.get("type") != kind or {"const", "enum", "$ref"} & schema.keys():
        return None

    def finite(v) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

    lows, highs = [], []
    for key, out in (("minimum", lows), ("maximum", highs)):
        value, exclusive = schema.get(key), schema.get("exclusiveM" + key[1:])
        if finite(value):
            out.append((value, exclusive is True))
        if finite(exclusive):
            out.append((exclusive, True))
    return (lows, highs) if lows or highs else None


def string_lengths(schema: dict) -> tuple[int, int | None]:
    """A string schema's (minLength, maxLength or None); ValueError for a bad one."""
    out = []
    for key, default in (("minLength", 0), ("maxLength", None)):
        value = schema.get(key, default)
        if value is None:
            out.append(value)
            continue
        whole = isinstance(value, int | float) and not isinstance(value, bool)
        if not whole or not math.isfinite(value) or value != int(value) or value < 0:
            raise ValueError(f"{key} must be a whole number of characters, not {value!r}")
        out.append(int(value))
    if out[1] is not None and out[0] > out[1]:
        raise ValueError(f"no string has at least {out[0]} and at most {out[1]} characters")
    return out[0], out[1]


def integer_bounds(schema: dict) -> tuple[int | None, int | None] | None:
    """(lowest, highest) an integer schema allows (None: no bound), or None when it is not
    an integer schema with a bound (see _bounds)."""
    bounds = _bounds(schema, "integer")
    if bounds is None:
        return None
    lows = [math.floor(v) + 1 if ex else math.ceil(v) for v, ex in bounds[0]]
    highs = [math.ceil(v) - 1 if ex else math.floor(v) for v, ex in bounds[1]]
    lo, hi = max(lows, default=None), min(highs, default=None)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"no integer is at least {lo} and at most {hi}")
    return lo, hi


def integer_rule(lo: int | None, hi: int | None) -> str:
    """GBNF for a JSON integer in [lo, hi] (None: unbounded), without leading zeros, as
    llama.cpp's build_min_max_int does; an unbounded side stops at MAX_DIGITS digits (or at
    the other bound's, if it has more)."""
    top = 10 ** max(MAX_DIGITS, *(len(str(abs(b))) for b in (lo, hi) if b is not None)) - 1
    alts = []
    if lo is None or lo < 0:  # the negative ones, by their magnitude
        magnitudes = (max(1, -hi) if hi is not None and hi < 0 else 1, top if lo is None else -lo)
        alts += [f'"-" ({_magnitudes(*magnitudes)})']
    if hi is None or hi >= 0:
        alts += [_magnitudes(max(lo or 0, 0), top if hi is None else hi)]
    return " | ".join(alts)


def _magnitudes(lo: int, hi: int) -> str:
    """GBNF for the decimal numbers lo..hi (0 <= lo <= hi), digit count by digit count."""
    alts = []
    most = len(str(hi))
    for digits in range(len(str(lo)), most + 1):
        a = max(lo, 10 ** (digits - 1) if digits > 1 else 0)
        if digits > 1 and a == 10 ** (digits - 1) and hi == 10**most - 1:  # all from here on
            alts.append(f"[1-9] [0-9]{{{digits - 1},{most - 1}}}")
            break
        alts += _same_length(str(a), str(min(hi, 10**digits - 1)))
    return " | ".join(alts)


def _same_length(a: str, b: str) -> list[str]:
    """Alternatives for the numbers a..b written with the same number of digits."""
    i = next((k for k in range(len(a)) if a[k] != b[k]), len(a))
    prefix = [f'"{a[:i]}"'] if i else []
    if i == len(a):
        return [" ".join(prefix)]
    rest = len(a) - i - 1

    def any_digits(n: int) -> list[str]:
        return [f"[0-9]{{{n}}}"] if n > 1 else ["[0-9]"] if n else []

    def digit(x: int, y: int) -> str:
        return f"[{x}]" if x == y else f"[{x}-{y}]"

    x, y = int(a[i]), int(b[i])
    low_full = a[i + 1 :] == "0" * rest  # a's digit takes every tail
    high_full = b[i + 1 :] == "9" * rest
    first, last = x if low_full else x + 1, y if high_full else y - 1
    alts = []
    if not low_full:
        tails = " | ".join(_same_length(a[i + 1 :], "9" * rest))
        alts.append(" ".join([*prefix, f"[{x}]", f"({tails})"]))
    if first <= last:
        alts.append(" ".join([*prefix, digit(first, last), *any_digits(rest)]))
    if not high_full:
        tails = " | ".join(_same_length("0" * rest, b[i + 1 :]))
        alts.append(" ".join([*prefix, f"[{y}]", f"({tails})"]))
    return alts


def number_bounds(schema: dict) -> tuple | None:
    """(lowest, exclusive?, highest, exclusive?) of a number schema, as Decimals (None: no
    bound on that side), or None when it has no bound (see _bounds). A float bound is read
    as its shortest spelling: 0.1 is 0.1, not the binary value nearest it."""
    bounds = _bounds(schema, "number")
    if bounds is None:
        return None
    lows, highs = ([(Decimal(str(v)), ex) for v, ex in side] for side in bounds)
    # At one value the exclusive bound is the tighter.
    lo, lo_ex = max(lows, key=lambda b: (b[0], b[1]), default=(None, False))
    hi, hi_ex = min(highs, key=lambda b: (b[0], not b[1]), default=(None, False))
    if lo is not None and hi is not None and (lo > hi or lo == hi and (lo_ex or hi_ex)):
        raise ValueError(f"no number is within {lo} and {hi}")
    return lo, lo_ex, hi, hi_ex


#: A bounded number's fraction (at most 16 digits, as the converters' decimal part, and as
#: many more as a bound's own fraction needs).
_FRACTION = '"." [0-9]{1,16}'
_TAIL = "[0-9]{0,15}"


def number_rule(lo: Decimal | None, lo_ex: bool, hi: Decimal | None, hi_ex: bool) -> str:
    """GBNF for a JSON number between lo and hi (None: unbounded; _ex: exclusive), without
    an exponent."""
    alts = []
    if hi is None or hi > 0 or hi == 0 and not hi_ex:  # zero and up
        low = (lo, lo_ex) if lo is not None and lo >= 0 else (Decimal(0), False)
        alts += [_between(*low, hi, hi_ex)]
    if lo is None or lo < 0:  # below zero, by magnitude ("-0" where zero is allowed)
        if hi is not None and (hi < 0 or hi == 0 and hi_ex):
            low = (-hi, hi_ex)
        else:
            low = (Decimal(0), False)
        below = _between(*low, None if lo is None else -lo, lo_ex)
        alts += [f'"-" ({below})' if below else ""]
    return " | ".join(f"({a})" for a in alts if a)


def _between(c: Decimal, c_ex: bool, d: Decimal | None, d_ex: bool) -> str:
    """GBNF for the magnitudes from c to d (0 <= c; None: no end; _ex: exclusive), by
    integer part: between the bounds' integer parts any fraction, at theirs the fractions
    on the right side of the bounds' own."""
    (ci, cf), (di, df) = _parts(c), _parts(d) if d is not None else (None, "")
    if di == ci:
        return _point(ci, _fraction_between(cf, c_ex, df, d_ex))
    top = 10 ** max(MAX_DIGITS, len(str(ci)), len(str(di or 0))) - 1
    alts = [_point(ci, _fraction_from(cf, c_ex))]
    end = top if d is None else di - 1
    if ci + 1 <= end:
        alts.append(f"({_magnitudes(ci + 1, end)}) ({_FRACTION})?")
    if d is not None:
        alts.append(_point(di, _fraction_to(df, d_ex)))
    return " | ".join(a for a in alts if a)


def _parts(x: Decimal) -> tuple[int, str]:
    """A magnitude's integer part and its fraction's digits, without trailing zeros."""
    whole, _, fraction = f"{x:f}".partition(".")
    return int(whole), fraction.rstrip("0")


#: Fractions are written as (GBNF of the digit strings after the point that are allowed, or
#: None for no such string; whether no fraction at all is allowed).
Fraction = tuple[str | None, bool]


def _point(whole: int | str, fraction: Fraction) -> str:
    """GBNF for `whole` followed by one of the fractions (and their point), or ""."""
    digits, bare = fraction
    if digits is None:
        return f'"{whole}"' if bare else ""
    return f'"{whole}" ("." ({digits}))' + ("?" if bare else "")


def _then(digit: int, fraction: Fraction) -> str | None:
    """GBNF for the digit strings `digit` followed by one of the fraction's strings."""
    digits, bare = fraction
    if digits is None:
        return f'"{digit}"' if bare else None
    return f'"{digit}" ({digits})' + ("?" if bare else "")


def _digits(x: int, y: int) -> str | None:
    """One digit from x to y, then any digits; None when x > y."""
    return None if x > y else f"[{x}-{y}] {_TAIL}"


def _fraction_from(a: str, exclusive: bool) -> Fraction:
    """The fractions f with 0.f >= 0.a (> when exclusive); a: digits, "" for zero."""
    if not a:
        return ('"0"{0,15} [1-9] [0-9]{0,15}', False) if exclusive else ("[0-9]{1,16}", True)
    x = int(a[0])
    return _either_of([_digits(x + 1, 9), _then(x, _fraction_from(a[1:], exclusive))]), False


def _fraction_to(b: str, exclusive: bool) -> Fraction:
    """The fractions f with 0.f <= 0.b (< when exclusive); b: digits, "" for zero."""
    if not b:
        return (None, False) if exclusive else ('"0"{1,16}', True)
    y = int(b[0])
    return _either_of([_digits(0, y - 1), _then(y, _fraction_to(b[1:], exclusive))]), True


def _fraction_between(a: str, a_ex: bool, b: str, b_ex: bool) -> Fraction:
    """The fractions f with 0.a <= 0.f <= 0.b (each < where exclusive), 0.a <= 0.b."""
    if not a and not a_ex:
        return _fraction_to(b, b_ex)
    if not b:  # nothing is above zero and at most zero
        return None, False
    x, y = int(a[0]) if a else 0, int(b[0])
    if x == y:
        return _then(x, _fraction_between(a[1:], a_ex, b[1:], b_ex)), False
    low = _then(x, _fraction_from(a[1:], a_ex))
    high = _then(y, _fraction_to(b[1:], b_ex))
    return _either_of([low, _digits(x + 1, y - 1), high]), False


# ---- pattern -------------------------------------------------------------------------------

#: The last code point; surrogates (D800-DFFF) are no characters of a UTF-8 answer.
_MAX = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)
#: ECMA-262's classes (JSON Schema's regular expressions are ECMA-262's): \d and \w are
#: ASCII there, \s is its white space and line terminators.
_CLASSES = {
    "CATEGORY_DIGIT": [(0x30, 0x39)],
    "CATEGORY_WORD": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
    "CATEGORY_SPACE": [
        (0x09, 0x0D),
        (0x20, 0x20),
        (0xA0, 0xA0),
        (0x1680, 0x1680),
        (0x2000, 0x200A),
        (0x2028, 0x2029),
        (0x202F, 0x202F),
        (0x205F, 0x205F),
        (0x3000, 0x3000),
        (0xFEFF, 0xFEFF),
    ],
}
#: ECMA-262's "." : any character but a line terminator.
_DOT = [(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]
#: JSON's short escapes; other control characters (and DEL) are written \u00XX.
_SHORT = {0x08: "b", 0x0C: "f", 0x0A: "n", 0x0D: "r", 0x09: "t"}
#: Above this many repetitions a pattern is refused rather than unrolled.
MAX_REPEAT = 1000


#: GBNF for the empty string.
_EMPTY = '""'


class _Unsupported(ValueError):
    """What a pattern holds that a grammar cannot express."""


def pattern_rule(
    pattern: str, char: str, min_length: int = 0, max_length: int | None = None
) -> str:
    """GBNF for a JSON string whose value matches `pattern` and has min_length to
    max_length characters (char: the rule of any string character, for what an unanchored
    pattern leaves free).

    Works on the decoded value, as JSON Schema means it, where llama.cpp's and llama-cpp-
    python's converters paste the regular expression into the JSON text: there "." or
    "[^a-z]" wrote a raw quote (ending the string early) or a raw backslash, "\\d" made a
    grammar llama.cpp cannot parse (llama.cpp's then accepts any string), a quantifier
    after an escape repeated the literals before it, "^yes|no$" lost its quotes, and an
    unanchored pattern or "(?:" was refused. Here each character the pattern allows is
    written as JSON writes it (a quote or backslash escaped, a control character as its
    escape), "\\d", "\\w" and "\\s" mean what ECMA-262 says, a side without "^" or "$"
    takes any characters (a pattern matches anywhere in the string), and what cannot be
    expressed (look-arounds, back-references, word boundaries, flags) is refused by name
    rather than ignored. Both converters drop minLength/maxLength beside a pattern; here
    the lengths are cut into the pattern's own repetitions (see _within).
    """
    try:
        # ECMA-262's named group (?<name>...) is Python's (?P<name>...).
        parsed = P.parse(re.sub(r"\(\?<(?=[A-Za-z_])", "(?P<", pattern))
        if parsed.state.flags & ~C.SRE_FLAG_UNICODE:  # Python's inline flags: not ECMA's
            raise _Unsupported("inline flags")
        top = list(parsed)
        if len(top) == 1 and str(top[0][0]) == "BRANCH":
            tree = ("alt", tuple(_anchored(b, char) for b in top[0][1][1]))
        else:
            tree = _anchored(top, char)
        body = _plain(tree)
        if min_length or max_length is not None:
            try:
                top = math.inf if max_length is None else max_length
                body = _within(tree, min_length, top, _Cuts())
            except (_TooLarge, RecursionError):  # the pattern alone, as both converters
                pass  # hold it (README); a long unrolled repetition is too deep to write
            if body is None:
                length = f"{min_length} to {'any' if max_length is None else max_length}"
                raise ValueError(f"pattern /{pattern}/ matches no string of {length} characters")
    except re.error as exc:
        raise ValueError(f"pattern /{pattern}/ is not a regular expression: {exc}") from None
    except _Unsupported as exc:
        raise ValueError(f"pattern /{pattern}/: {exc} cannot be expressed as a grammar") from None
    return f'"\\"" ({body or _EMPTY}) "\\"" space'


# A pattern as a tree of tuples, before it is written: ("lit", GBNF literal, characters),
# ("one", GBNF of one character), ("seq", trees), ("alt", trees) and ("rep", tree, least,
# most or None). Each character of the decoded value is one "one" or one of a "lit"'s, so a tree's
# lengths are known (_span) and a length bound can be cut into it (_within).


def _anchored(items, char: str) -> tuple:
    """One alternative of a whole pattern, taking any characters on a side it does not
    anchor with ^ or $."""
    items = list(items)
    start = bool(items) and str(items[0][0]) == "AT" and "BEGINNING" in str(items[0][1])
    end = bool(items) and str(items[-1][0]) == "AT" and "END" in str(items[-1][1])
    free = ("rep", ("one", char), 0, None)
    body = _tree(items[int(start) : len(items) - int(end)])
    if not body[1] and not (start and end):
        return free  # one side free is any string: once, not twice
    return ("seq", (free,) * (not start) + (body,) + (free,) * (not end))


def _tree(items) -> tuple:
    """The tree of a parsed (re._parser) sequence."""
    parts: list[tuple] = []
    literal, count = "", 0
    for op, av in items:
        name = str(op)
        if name == "LITERAL":
            literal += _json_char(av)
            count += 1
            continue
        if literal:
            parts.append(("lit", _gbnf_literal(literal), count))
            literal, count = "", 0
        if name == "NOT_LITERAL":
            parts.append(("one", _chars(_complement([(av, av)]))))
        elif name == "ANY":
            parts.append(("one", _chars(_complement(_DOT))))
        elif name == "IN":
            parts.append(("one", _chars(_class(av))))
        elif name == "BRANCH":
            parts.append(("alt", tuple(_tree(b) for b in av[1])))
        elif name == "SUBPATTERN":
            _, add, remove, sub = av
            if add or remove:
                raise _Unsupported("a group with flags")
            parts.append(_tree(sub))
        elif name in ("MAX_REPEAT", "MIN_REPEAT"):  # greedy or lazy: the same strings
            lo, hi, sub = av
            unbounded = hi == C.MAXREPEAT
            if lo > MAX_REPEAT or not unbounded and hi > MAX_REPEAT:
                raise _Unsupported(f"a repetition of more than {MAX_REPEAT}")
            parts.append(("rep", _tree(sub), lo, None if unbounded else hi))
        elif name == "AT":
            raise _Unsupported("an anchor (^, $, \\b, \\B) inside the pattern")
        elif name == "GROUPREF":
            raise _Unsupported("a back-reference")
        else:  # ASSERT, ASSERT_NOT (look-arounds), ATOMIC_GROUP, POSSESSIVE_REPEAT, ...
            raise _Unsupported(name.lower().replace("_", " "))
    if literal:
        parts.append(("lit", _gbnf_literal(literal), count))
    return ("seq", tuple(parts))


def _plain(tree: tuple) -> str:
    """GBNF for every string of the tree; "" for the empty string alone."""
    kind = tree[0]
    if kind in ("lit", "one"):
        return tree[1]
    if kind == "seq":
        return _join(*map(_plain, tree[1]))
    if kind == "alt":
        return _either_of([_plain(t) for t in tree[1]])
    _, sub, lo, hi = tree
    return _repeat(_plain(sub), lo, hi)


def _repeat(body: str, lo: int, hi: int | float | None) -> str:
    """GBNF for `body` lo to hi times (None or inf: no end)."""
    if not body or hi == 0:  # the empty string, however often
        return ""
    if hi is None or hi == math.inf:
        count = "*" if lo == 0 else "+" if lo == 1 else f"{{{lo},}}"
    elif (lo, hi) == (0, 1):
        count = "?"
    elif (lo, hi) == (1, 1):
        return body
    else:
        count = f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"
    return f"{_atom(body)}{count}"


@functools.lru_cache(maxsize=4096)
def _span(tree: tuple) -> tuple[int, float]:
    """The fewest and most characters of the tree's strings (inf: no most)."""
    kind = tree[0]
    if kind == "lit":
        return tree[2], tree[2]
    if kind == "one":
        return 1, 1
    if kind == "rep":
        (a, b), lo, hi = _span(tree[1]), tree[2], tree[3]
        if b == 0 or hi == 0:
            return 0, 0
        return a * lo, math.inf if hi is None else b * hi
    spans = [_span(t) for t in tree[1]]
    if kind == "seq":
        return sum(a for a, _ in spans), sum(b for _, b in spans)
    return min(a for a, _ in spans), max(b for _, b in spans)


#: Alternatives a length bound may try, and characters its grammar may take; beyond either
#: it is left out (GBNF written inline shares no part, so a bound over several unbounded
#: parts grows with its square, and over an unrolled repetition of choices exponentially).
MAX_LENGTH_ALTERNATIVES = 4096
MAX_LENGTH_GRAMMAR = 64 << 10


class _TooLarge(Exception):
    """A length bound would take more than MAX_LENGTH_ALTERNATIVES or MAX_LENGTH_GRAMMAR."""


class _Cuts:
    """One length bound's work: what each (tree, lo, hi) gave, and the alternatives tried
    (an unrolled repetition reaches the same remainders by many paths)."""

    def __init__(self):
        self.done: dict[tuple, str | None] = {}
        self.tried = 0


def _within(tree: tuple, lo: int, hi: float, cuts: _Cuts) -> str | None:
    """GBNF for the tree's strings of lo to hi characters (hi may be inf), or None when
    there is none. A fixed-width repetition takes the counts that fit; a sequence with
    several parts of varying length gives the first such part each length in turn, the
    rest the remainder. _TooLarge past MAX_LENGTH_ALTERNATIVES or MAX_LENGTH_GRAMMAR."""
    a, b = _span(tree)
    lo, hi = max(lo, a), min(hi, b)
    if lo > hi:
        return None
    if (lo, hi) == (a, b):
        return _plain(tree)
    if (tree, lo, hi) not in cuts.done:
        cut = cuts.done[tree, lo, hi] = _cut(tree, lo, hi, cuts)
        if cut is not None and len(cut) > MAX_LENGTH_GRAMMAR:
            raise _TooLarge
    return cuts.done[tree, lo, hi]


def _cut(tree: tuple, lo: int, hi: float, cuts: _Cuts) -> str | None:
    """_within for a tree whose lengths reach beyond lo to hi."""
    kind = tree[0]
    if kind == "alt":
        alts = [x for x in (_within(t, lo, hi, cuts) for t in tree[1]) if x is not None]
        return _either_of(alts)
    if kind == "rep":
        _, sub, m, n = tree
        sa, sb = _span(sub)
        if sa == sb:  # a fixed width: the counts that fit
            most = math.inf if n is None else n
            least, most = max(m, -(-lo // sa)), most if hi == math.inf else min(most, hi // sa)
            return _repeat(_plain(sub), least, most) if least <= most else None
        if sa == 0:
            raise _TooLarge  # a repetition of what may be empty: no count bounds its length
        less = None if n is None else n - 1  # one repetition, then the rest
        once = ("seq", (sub, ("rep", sub, max(m - 1, 0), less)))
        return _within(once if m else ("alt", (("seq", ()), once)), lo, hi, cuts)
    return _seq_within(tree[1], lo, hi, cuts)


def _seq_within(items: tuple, lo: int, hi: float, cuts: _Cuts) -> str | None:
    spans = [_span(t) for t in items]
    varying = [i for i, (a, b) in enumerate(spans) if a != b]
    i = varying[0]  # there is one: a fixed sequence was either in range or empty
    head, part, rest = items[:i], items[i], items[i + 1 :]
    fixed = sum(a for a, _ in spans[:i])
    ra, rb = _span(("seq", rest))
    pa, pb = spans[i]
    alts = []
    if len(varying) == 1:  # the rest is fixed too
        middle = _within(part, lo - fixed - ra, hi - fixed - ra, cuts)
        alts = [] if middle is None else [_join(middle, _plain(("seq", rest)))]
    else:
        first = max(pa, lo - fixed - rb)
        last = min(pb, hi - fixed - ra)
        free = lo - fixed - ra  # from this length of the part on, the rest has no floor
        k, size = first, 0
        while k <= last:
            cuts.tried += 1  # counted before the work: it bounds the work too
            if cuts.tried > MAX_LENGTH_ALTERNATIVES:
                raise _TooLarge
            if hi == math.inf and k >= free:  # the rest is then free: one alternative
                pair = (_within(part, k, math.inf, cuts), _plain(("seq", rest)))
                last = -1
            else:
                pair = (
                    _within(part, k, k, cuts),
                    _within(("seq", rest), lo - fixed - k, hi - fixed - k, cuts),
                )
                k += 1
            if None not in pair:
                alts.append(_join(*pair))
                size += len(alts[-1])
                if size > MAX_LENGTH_GRAMMAR:
                    raise _TooLarge
    body = _either_of(alts)
    return None if body is None else _join(_plain(("seq", head)), body)


def _join(*parts: str) -> str:
    """GBNF for the parts in a row ("" is the empty string)."""
    return " ".join(p for p in parts if p)


def _either_of(alts: list[str | None]) -> str | None:
    """GBNF for any of the alternatives ("" is the empty string, None none), or None for
    none at all."""
    alts = list(dict.fromkeys(a for a in alts if a is not None))
    if len(alts) < 2:
        return alts[0] if alts else None
    return "(" + " | ".join(a or _EMPTY for a in alts) + ")"


def _atom(body: str) -> str:
    """The body as one GBNF term: in parentheses unless it is one character class."""
    return body if re.fullmatch(r"\[[^\]]*\]|[\w-]+", body) else f"({body})"


def _class(items) -> list[tuple[int, int]]:
    """A character class's code point ranges."""
    out, negate = [], False
    for op, av in items:
        name = str(op)
        if name == "NEGATE":
            negate = True
        elif name == "LITERAL":
            out.append((av, av))
        elif name == "RANGE":
            out.append(av)
        elif name == "CATEGORY" and str(av).replace("_NOT", "") in _CLASSES:
            base = _CLASSES[str(av).replace("_NOT", "")]
            out += _complement(base) if "_NOT_" in str(av) else base
        else:
            raise _Unsupported(f"{av} in a character class")
    return _complement(out) if negate else _merge(out)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, at = [], 0
    for lo, hi in _merge(ranges):
        if lo > at:
            out.append((at, lo - 1))
        at = hi + 1
    if at <= _MAX:
        out.append((at, _MAX))
    return out


def _minus(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    out = []
    for a, b in ranges:
        if b < lo or a > hi:
            out.append((a, b))
            continue
        if a < lo:
            out.append((a, lo - 1))
        if b > hi:
            out.append((hi + 1, b))
    return out


def _json_char(c: int) -> str:
    """A character as a JSON string writes it."""
    if c == 0x22:
        return '\\"'
    if c == 0x5C:
        return "\\\\"
    if c < 0x20 or c == 0x7F:
        return "\\" + _SHORT[c] if c in _SHORT else f"\\u{c:04x}"
    return chr(c)


def _gbnf_literal(text: str) -> str:
    """A GBNF string literal of this text (its quotes and backslashes escaped)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _gbnf_code(c: int) -> str:
    if chr(c).isascii() and chr(c).isalnum():
        return chr(c)
    return f"\\x{c:02X}" if c < 0x100 else f"\\u{c:04X}" if c < 0x10000 else f"\\U{c:08X}"


def _chars(ranges: list[tuple[int, int]]) -> str:
    """GBNF for one character of these ranges as JSON writes it: raw where JSON allows it;
    a quote, a backslash, control characters and DEL as their escapes."""
    raw = ranges
    for lo, hi in (*_ESCAPED_ONLY, _SURROGATES):
        raw = _minus(raw, lo, hi)
    alts = []
    if raw:
        body = "".join(
            _gbnf_code(lo) if lo == hi else f"{_gbnf_code(lo)}-{_gbnf_code(hi)}" for lo, hi in raw
        )
        alts.append(f"[{body}]")
    inside = {c for lo, hi in ranges for c in range(lo, min(hi, 0x7F) + 1)}
    # What follows the backslash of each escaped one: a letter or itself, else u00XX.
    escaped = [
        _json_char(c)[1:] for c in sorted(inside) if any(a <= c <= b for a, b in _ESCAPED_ONLY)
    ]
    short = "".join("\\" + e if e in '"\\' else e for e in escaped if len(e) == 1)
    escapes = [f"[{short}]"] if short else []
    if inside.issuperset(range(0x20)):  # every control character: any \u00XX of them
        escapes.append('"u00" [01] [0-9a-fA-F]')
        escapes += ['"u007" [fF]'] if 0x7F in inside else []
    else:
        escapes += [_gbnf_literal(e) for e in escaped if len(e) > 1]
    if escapes:
        alts.append('"\\\\" ' + (escapes[0] if len(escapes) == 1 else f"({' | '.join(escapes)})"))
    if not alts:
        raise _Unsupported("a class no character matches")
    return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"
