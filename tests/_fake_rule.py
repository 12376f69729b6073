"""A stand-in for the core's rule (:class:`abstractdiff._custom.Rule`), for testing an
adapter's ``custom_rule`` hook on its own (``tests/test_custom_rule_<library>.py``).

``FakeRule(xp, kind)`` is ``g(x, y) = (sum(x**2) * y,)`` with deliberately wrong rules, so a
test tells the rule from the function's own derivative: the backward gives
``(3 * ct * x * y, ct * sum(x**2))`` (d/dx is 3xy, not 2xy) and the jvp
``3 * y * <x, tx> + sum(x**2) * ty``.  ``xp`` is the library's numpy-like module (``sum_``
its sum where the module has none by that name); ``kind`` is "vjp" (a custom_vjp: the
backward only) or "jvp" (a custom_jvp: the jvp only).  Under the rule, the Hessian of
``g(x, y)[0]`` in x is ``3 * y * I``.
"""

from __future__ import annotations

from abstractdiff._errors import AbstractDiffError


class FakeRule:
    def __init__(self, xp, kind="vjp", sum_=None):
        self.xp, self.kind = xp, kind
        self.sum = sum_ or xp.sum
        self.name = "fake_g"
        self.has_vjp = kind == "vjp"
        self.has_jvp = kind == "jvp"
        self.stops_gradient = False
        self.nested_derivatives = True
        self.lazy_forward = False
        self.derivatives_in_jvp = True
        self.takes_derivatives = False  # only ad.custom_root's rules differentiate inside
        self.calls = {"forward": 0, "backward": 0, "jvp": 0}

    def with_inputs(self, inputs):
        return self  # its rules make nothing from the call's arguments

    def value(self, x, y):
        return (self.sum(x * x) * y,)

    def forward(self, x, y):
        self.calls["forward"] += 1
        s = self.sum(x * x)
        return (s * y,), (x, y, s)

    def backward(self, residuals, cotangents):
        if not self.has_vjp:
            raise self.no_vjp_error()
        self.calls["backward"] += 1
        x, y, s = residuals
        (ct,) = cotangents
        return (3 * ct * x * y, ct * s)

    def jvp(self, primals, tangents):
        if not self.has_jvp:
            raise self.no_jvp_error()
        self.calls["jvp"] += 1
        x, y = primals
        tx, ty = tangents
        s = self.sum(x * x)
        return (s * y,), (3 * y * self.sum(x * tx) + s * ty,)

    def no_vjp_error(self):
        return AbstractDiffError(f"{self.name}: reverse mode needs custom_vjp (this library cannot transpose a "
                                 f"custom_jvp rule)")

    def no_jvp_error(self):
        return AbstractDiffError(f"{self.name}: forward mode needs custom_jvp (custom_vjp has no forward rule)")

    def second_order_error(self, library):
        return AbstractDiffError(f"{self.name}: {library} cannot differentiate this rule again (a second "
                                 f"derivative through a custom rule)")
