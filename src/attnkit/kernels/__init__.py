"""Backends that compute exact attention: reference, chunked, sdpa, flex (see dispatch.py)."""

from .chunked import TILING, Tiling, choose_engine, chunked_attention
from .dispatch import BACKENDS, choose_backend, explain_request
from .reference import reference_attention, reference_probabilities, reference_scores
from .request import Request, empty_result, make_request

__all__ = [
    "BACKENDS",
    "TILING",
    "Tiling",
    "Request",
    "choose_backend",
    "choose_engine",
    "chunked_attention",
    "empty_result",
    "explain_request",
    "make_request",
    "reference_attention",
    "reference_probabilities",
    "reference_scores",
]
