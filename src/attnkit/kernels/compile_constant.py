"""``constant_for_compile``: what ``torch.compiler.assume_constant_result`` does, without
importing ``torch._dynamo``.

That decorator imports torch._dynamo on first use (about a second), so applying it at
module level made every process that imports attnkit (the CLI, each sweep worker) a second
slower to start. It only sets a mark that torch.compile reads while tracing; this sets the
same mark. tests/kernels/test_cpu_compile.py checks it still equals what torch's decorator sets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def constant_for_compile(fn: F) -> F:
    """torch.compile calls ``fn`` once while tracing and uses its result as a constant."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


__all__ = ["constant_for_compile"]
