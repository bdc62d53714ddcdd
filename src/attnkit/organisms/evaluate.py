"""An organism measured as users get it: the exported transformers model, on held-out prompts.

The card's numbers come from here, run on the files that ship: the export is loaded with
transformers (``AutoModelForCausalLM``, offline, float32; layers config.json records as
running another mechanism, sigmoid or linear, run it through ``attnkit.hf.use``), prompts are the arena task's
own held-out examples at each length, drawn from a stream no training run reads
(``"card"``), and scored as the arena scores them (accuracy of the answer positions,
per example group: the needle's depths). A re-check draws from another stream
(``"recheck"``), so it tests the card on prompts the card was not measured on.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..arena.export import mechanism_switch, read_task
from ..arena.trainer import generator
from ..extras import require

#: seed of the card's held-out prompts (the stream name keeps them apart from training's)
CARD_SEED = 0
#: tokens per forward pass while measuring (memory stays small at any length)
TOKENS_PER_FORWARD = 8192


class _Logits(torch.nn.Module):
    """A transformers causal LM as the arena's models are called: ids -> logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        with mechanism_switch(self.model):  # sigmoid or linear layers run as trained, not as Llama's softmax
            return self.model(input_ids=ids).logits


def load_export(directory: str):
    """(ids -> logits module, arena task) of the export in ``directory``."""
    require("transformers", "attnkit.organisms")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    task, _, _ = read_task(directory)
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # a measurement prints its own progress, not a loading bar
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    return _Logits(model.eval()), task


@torch.no_grad()
def accuracy_at(model, task, length: int, examples: int, stream: str = "card", seed: int = CARD_SEED) -> dict:
    """``{"accuracy", "counted", "groups": {name: accuracy}}`` of ``model`` on ``examples``
    held-out prompts of ``task`` at ``length``."""
    task = task if length == task.seq_len else replace(task, seq_len=length)
    data = task.held_out(examples, generator(seed, stream, length))
    names = task.group_names
    right = torch.zeros(max(1, len(names)), dtype=torch.float64)
    total = torch.zeros_like(right)
    step = max(1, TOKENS_PER_FORWARD // length)
    for start in range(0, len(data), step):
        batch = data.slice(start, start + step)
        correct, counted = task.scored(model(batch.inputs), batch)
        group = torch.zeros(len(batch), dtype=torch.long) if batch.group is None else batch.group
        right.index_add_(0, group, correct.sum(dim=1).double())
        total.index_add_(0, group, counted.sum(dim=1).double())
    groups = {name: round(float(right[i] / total[i]), 4) for i, name in enumerate(names) if total[i] > 0}
    return {"accuracy": round(float(right.sum() / total.sum()), 4), "counted": int(total.sum()), "groups": groups}


def measure(directory: str, lengths, examples: int, stream: str = "card", seed: int = CARD_SEED) -> dict:
    """Accuracy of the export in ``directory`` at each length: ``{str(length): accuracy_at(...)}``."""
    model, task = load_export(directory)
    return {str(n): accuracy_at(model, task, n, examples, stream, seed) for n in lengths}


__all__ = ["CARD_SEED", "accuracy_at", "load_export", "measure"]
