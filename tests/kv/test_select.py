"""``select.top`` (keep the ``count`` highest-scoring candidates, ties to the earlier
index) against a literal sort of each row, on rows with ties, with room for every
candidate, one too many (a decoding step's single eviction) and many too many."""

import torch

from attnkit.kv.select import last, top


def literal_top(scores, candidates, count):
    out = torch.zeros_like(candidates)
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in scores.shape[:-1]]).view(-1, scores.dim() - 1).tolist():
        idx = tuple(idx)
        c = int(torch.as_tensor(count).expand(scores.shape[:-1])[idx])
        members = candidates[idx].nonzero().flatten().tolist()
        members.sort(key=lambda j: (-float(scores[idx][j]), j))
        out[idx][members[:c]] = True
    return out


def test_top_equals_the_literal_ranking():
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        B, H, L = 2, 3, 9
        scores = torch.randint(0, 4, (B, H, L), generator=g).double()  # many ties
        candidates = torch.rand(B, H, L, generator=g) > 0.3
        n = candidates.sum(-1)
        shift = trial % 4 - 1  # count = candidates + 1, + 0, - 1 (one eviction), - 2
        count = torch.clamp(n - shift, min=0) if trial % 5 else torch.tensor(3)
        assert torch.equal(top(scores, candidates, count), literal_top(scores, candidates, count)), trial


def test_last_keeps_the_latest_valid_entries():
    valid = torch.tensor([[True, False, True, True, False, True]])
    assert last(valid, torch.tensor([2])).tolist() == [[False, False, False, True, False, True]]
    assert last(valid, torch.tensor([0])).tolist() == [[False] * 6]
    assert last(valid, torch.tensor([9])).tolist() == valid.tolist()
