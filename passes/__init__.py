"""Compiler passes: each is a pure function from one IR value to a new one."""
from rpcompile.passes.timing import iteration_time

__all__ = ["iteration_time"]
