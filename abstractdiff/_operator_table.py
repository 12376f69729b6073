"""The operator family as data: the one table the API, the CLI, ``testing`` and the
combinators read.

Each operator of DifferentiationInterface.jl's family is one :class:`Operator` row: its
name, its family (the operator it returns the value of, or extends), its derivative order,
the results it returns, and how it is called.  Code that needs a list of operators (the
public ``__all__``, the CLI's columns, the conformance grid's operators and their
references, implicit mode's operators, the tangent-taking call form) derives it from
:data:`OPERATORS`, so that adding an operator means adding its row, its preparation
(``abstractdiff._prepare``) and its derivation, not editing lists across the package.
This module imports no other module of abstractdiff.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OPERATORS", "Operator", "operators_where"]


@dataclass(frozen=True)
class Operator:
    """One operator of the family.

    ``parts`` are the results it returns, by the name of the reference the conformance
    suite checks each against (``("value", "gradient")`` for ``value_and_gradient``).
    """

    #: The public name: ``ad.<name>``, ``ad.prepare_<name>``, ``b.<name>``.
    name: str
    #: The operator it belongs to: the one-result operator it returns with more
    #: (``gradient`` for ``value_and_gradient`` and ``gradient_and_hvp``'s first part).
    family: str
    #: Derivative order (second-order operators get the looser tolerances).
    order: int
    #: The results it returns, by reference name.
    parts: tuple[str, ...]
    #: Called ``op(f, x, v, *args)``: it takes a tangent ``v`` shaped like ``x``.
    takes_tangent: bool = False
    #: Takes ``has_aux`` (``f`` returns ``(y, aux)``).
    takes_aux: bool = False
    #: Served by implicit-params mode (``ad.Implicit``: reverse mode over ``Params``).
    implicit: bool = False
    #: Part of the conformance grid (``testing``'s scenarios and the CLI's columns).
    graded: bool = True
    #: The CLI's short column name (keeps the table within ~120 characters).
    column: str = ""

    @property
    def prepare_name(self) -> str:
        """``prepare_<name>``: the public function that prepares it."""
        return f"prepare_{self.name}"

    @property
    def with_value(self) -> bool:
        """Whether it returns ``f``'s value first (``value_and_*``)."""
        return self.parts[0] == "value"


def _row(name: str, family: str, order: int, parts: tuple[str, ...], column: str = "", **flags: bool) -> Operator:
    return Operator(name, family, order, parts, column=column or name, **flags)


#: Every operator, in the order the CLI's table and the conformance report list them.
OPERATORS: dict[str, Operator] = {
    op.name: op
    for op in (
        _row("gradient", "gradient", 1, ("gradient",), takes_aux=True, implicit=True),
        _row("value_and_gradient", "gradient", 1, ("value", "gradient"), "value_grad", takes_aux=True,
             implicit=True),
        _row("pullback", "pullback", 1, ("pullback",), implicit=True),
        _row("value_and_pullback", "pullback", 1, ("value", "pullback"), implicit=True, graded=False),
        _row("pushforward", "pushforward", 1, ("pushforward",)),
        _row("value_and_pushforward", "pushforward", 1, ("value", "pushforward"), graded=False),
        _row("derivative", "derivative", 1, ("derivative",)),
        _row("value_and_derivative", "derivative", 1, ("value", "derivative"), "value_deriv"),
        _row("second_derivative", "second_derivative", 2, ("second_derivative",), "second_deriv"),
        _row("value_derivative_and_second_derivative", "second_derivative", 2,
             ("value", "derivative", "second_derivative"), "value_d_d2"),
        _row("jacobian", "jacobian", 1, ("jacobian",)),
        _row("value_and_jacobian", "jacobian", 1, ("value", "jacobian"), "value_jac"),
        _row("hessian", "hessian", 2, ("hessian",)),
        _row("value_gradient_and_hessian", "hessian", 2, ("value", "gradient", "hessian"), "value_g_hess"),
        _row("hvp", "hvp", 2, ("hvp",), takes_tangent=True),
        _row("gradient_and_hvp", "hvp", 2, ("gradient", "hvp"), "grad_hvp", takes_tangent=True),
    )
}


def operators_where(**flags: object) -> tuple[str, ...]:
    """The names of the operators whose attributes equal ``flags``, in table order
    (``operators_where(takes_tangent=True)``)."""
    return tuple(name for name, op in OPERATORS.items() if all(getattr(op, k) == v for k, v in flags.items()))
