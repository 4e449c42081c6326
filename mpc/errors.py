"""Errors of encrypted runs, each naming what went wrong and which party saw it."""

from __future__ import annotations


class MPCError(RuntimeError):
    """An encrypted run failed (a party died, did not join, or timed out)."""


class ModelMismatchError(MPCError):
    """The parties do not run the same public model (architecture, surrogates or settings)."""
