"""``steer.apply(model, *interventions)``: run a model with interventions inside ``with``.

The interventions reach the model through attnkit's attention function (``hf/attention.py``
reads ``EDITS`` on every call), so they work on every model ``attnkit.hf.use`` switches,
with its masks and KV cache. ``apply`` opens ``hf.use(model)`` itself unless a switch is
already in force; a ``hf.use`` opened inside keeps the steering (meters watch a steered
model), and ``apply`` inside ``apply`` adds to the outer interventions. On exit, also
after an exception, the model is as it was: edits, hooks and the switch restored.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

from torch import nn

from .base import Intervention


class Steering:
    """The edits of one ``apply`` block, consulted by attnkit's attention function."""

    def __init__(self, interventions: list[Intervention]):
        self.interventions = list(interventions)

    def scores(self, layer, query, key, keep):
        return [m for iv in self.interventions for m in iv.scores_for(layer, query, key, keep)]

    def output(self, layer, out, keep):
        for iv in self.interventions:
            out = iv.output_for(layer, out, keep)
        return out

    def __repr__(self):
        return f"Steering({', '.join(map(repr, self.interventions))})"


@contextmanager
def apply(model: nn.Module, *interventions: Intervention):
    """Steer ``model`` with ``interventions`` for the duration of the ``with`` block.
    Yields the ``Steering`` (its ``interventions`` are the copies bound to ``model``)."""
    from ..hf.attention import EDITS
    from ..hf.switch import active_switch, check_model, switched_modules, use

    check_model(model)
    if not interventions:
        raise ValueError("interventions: expected at least one (emphasize, ablate, scale, temperature, disperse, ...)")
    for i, iv in enumerate(interventions):
        if not isinstance(iv, Intervention):
            raise ValueError(f"interventions: argument {i + 1} is a {type(iv).__name__}, not an attnkit.steer intervention")
    bound = [iv.bind(model) for iv in interventions]  # every check before anything changes
    modules = switched_modules(model)  # a vision-language model: its decoder's layers only
    saved = {m: EDITS.get(m) for m in modules}
    with ExitStack() as stack:
        try:
            if active_switch(model)[0] is None:
                stack.enter_context(use(model))
            for iv in bound:
                iv.prepare(model)
            outer = saved.get(model)
            steering = Steering((outer.interventions if isinstance(outer, Steering) else []) + bound)
            for m in modules:
                EDITS[m] = steering
            for iv in bound:
                for handle in iv.hooks(model):
                    stack.callback(handle.remove)
            yield steering
        finally:
            for m, previous in saved.items():
                if previous is None:
                    EDITS.pop(m, None)
                else:
                    EDITS[m] = previous
