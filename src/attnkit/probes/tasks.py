"""The retrieval tasks that studies built on the probes run (kv-curves, head-ablation):
the needle probe's prompts (by length and depth) or the kv-retrieval probe's (by the
gold pair's position), in an arena export's own tokens or in natural language."""

from __future__ import annotations

from .retrieval import check_ints

TASKS = ("needle", "kv-retrieval")


def task_items(pm, task: str, lengths, depths, pairs, samples: int, seed: int):
    """(the task's prompts, the columns that locate a prompt, answer tokens to generate)."""
    if task not in TASKS:
        raise ValueError(f"task: expected one of {', '.join(TASKS)}, got {task!r}")
    if task == "needle":
        from . import needle

        if pairs is not None:
            raise ValueError("pairs: applies to --task kv-retrieval")
        if pm.task is not None:
            lengths = check_ints(pm.task.get("eval_lengths") if lengths is None else lengths, "lengths", 4)
            items = needle.arena_items(pm, lengths, depths, samples, seed)
            return items, ("length", "depth"), len(items[0].answer_ids or ())
        lengths = check_ints([1024] if lengths is None else lengths, "lengths", 16)
        items, needed = needle.text_items(pm, lengths, depths, samples, seed)
        return items, ("length", "depth"), needed
    from . import kv_retrieval
    from .retrieval import arena_symbols

    if pm.task is not None:
        sym = arena_symbols(pm, "kv-curves")
        pairs = check_ints([min(8, len(sym["keys"]), len(sym["values"]))] if pairs is None else pairs, "pairs", 1)
        length = None
        if lengths is not None:
            lengths = check_ints(lengths, "lengths", 4)
            if len(lengths) != 1:
                raise ValueError("lengths: kv-retrieval spreads its pairs through one prompt length; give one")
            length = lengths[0]
        items = kv_retrieval.arena_items(sym, pairs, depths, samples, seed, length, keyword="lengths")
        return items, ("pairs", "position"), 1
    if lengths is not None:
        raise ValueError("lengths: a natural-language kv-retrieval prompt's length follows from --pairs")
    items = kv_retrieval.text_items(pm, check_ints([10] if pairs is None else pairs, "pairs", 1), depths, samples, seed)
    return items, ("pairs", "position"), max(len(it.answer_ids or ()) for it in items)


__all__ = ["TASKS", "task_items"]
