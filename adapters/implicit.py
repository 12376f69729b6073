"""Compatibility: ``ad.Implicit`` is a core combinator now (:mod:`abstractdiff._implicit_backend`)."""

from abstractdiff._implicit_backend import Implicit

__all__ = ["Implicit"]
