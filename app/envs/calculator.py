"""A safe arithmetic evaluator for the calculator tool (app.envs.builtin.CalculatorEnv).

`evaluate(expression)` parses with `ast` and walks the tree itself (no `eval`): numbers
(ints and floats, "1,000" thousands separators allowed), + - * / // % **, unary minus and plus,
parentheses. Names, calls, attributes, subscripts, comparisons, bit operations and every other
construct are refused, and so are an exponent above MAX_EXPONENT in magnitude, a result above
MAX_MAGNITUDE and an expression longer than MAX_EXPRESSION_CHARS, so no input can make it run
long or allocate much. `calculate(expression)` is the tool: the value as text, or "error: ..."
(it never raises).
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_SYMBOL = {ast.BitXor: "^ (use ** for powers)", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<",
           ast.RShift: ">>", ast.MatMult: "@", ast.Invert: "~", ast.Not: "not"}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate."""


def _checked(value: Number) -> Number:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"result exceeds {MAX_MAGNITUDE:.0e} in magnitude")
    return value


def _power(base: Number, exponent: Number) -> Number:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent} exceeds {MAX_EXPONENT} in magnitude")
    if base == 0 and exponent < 0:
        raise CalculatorError("zero to a negative power")
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise CalculatorError(f"result exceeds {MAX_MAGNITUDE:.0e} in magnitude")
    result = base**exponent
    if isinstance(result, complex):
        raise CalculatorError("negative number to a fractional power")
    return result


def _node_name(node: ast.AST) -> str:
    op = getattr(node, "op", None)
    if op is not None and type(op) in _SYMBOL:
        return f"operator {_SYMBOL[type(op)]}"
    names = {ast.Name: "names", ast.Call: "function calls", ast.Attribute: "attributes",
             ast.Subscript: "subscripts", ast.Compare: "comparisons", ast.BoolOp: "and/or",
             ast.Tuple: "tuples (',' outside a number)", ast.Lambda: "lambdas", ast.IfExp: "if/else"}
    return names.get(type(node), type(node).__name__)


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"{node.value!r} is not a number")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _checked(_power(left, right))
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        return _checked(_BINARY[type(node.op)](left, right))
    raise CalculatorError(f"{_node_name(node)} not allowed; use numbers, + - * / // % ** and parentheses")


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression; CalculatorError saying what is wrong otherwise."""
    text = _THOUSANDS.sub("", expression.strip())
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"cannot parse {text!r} ({exc.msg})") from None
    except (RecursionError, MemoryError, ValueError):
        raise CalculatorError(f"cannot parse {text[:40]!r}") from None
    try:
        return _eval(tree.body)
    except (OverflowError, RecursionError):
        raise CalculatorError("result too large") from None


def format_number(value: Number) -> str:
    """Integers as digits, floats with up to 12 significant digits ("2.5", "0.333333333333")."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return format(value, ".12g")
    return str(value)


def calculate(expression: str) -> str:
    """The calculator tool: the expression's value as text, or "error: <reason>"; never raises."""
    try:
        return format_number(evaluate(expression))
    except CalculatorError as exc:
        return f"error: {exc}"
    except Exception as exc:  # noqa: BLE001 (the tool must answer, never crash a rollout)
        return f"error: {type(exc).__name__}: {exc}"


__all__ = ["MAX_EXPONENT", "MAX_EXPRESSION_CHARS", "MAX_MAGNITUDE", "CalculatorError", "calculate", "evaluate",
           "format_number"]
