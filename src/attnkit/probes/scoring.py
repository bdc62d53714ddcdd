"""How generated answers are scored: RULER's string matches (Hsieh et al. 2024, arXiv
2404.06654), case-insensitive substring tests of the reference answers in the output."""

from __future__ import annotations


def _check(prediction, references) -> list[str]:
    if not isinstance(prediction, str):
        raise ValueError(f"prediction: expected text, got {type(prediction).__name__}")
    if isinstance(references, str) or not references or not all(isinstance(r, str) and r for r in references):
        raise ValueError(f"references: expected a non-empty list of non-empty strings, got {references!r}")
    return [r.lower() for r in references]


def string_match_all(prediction: str, references: list[str]) -> float:
    """Fraction of the references found in the prediction (RULER's score for tasks with
    several answers: every value of a multi-value needle must appear)."""
    text = prediction.lower()
    refs = _check(prediction, references)
    return sum(r in text for r in refs) / len(refs)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1 when any reference is found in the prediction, else 0 (RULER's score for the QA
    tasks, where any of several phrasings is right)."""
    text = prediction.lower()
    return float(any(r in text for r in _check(prediction, references)))
