"""``select.top`` (keep the ``count`` highest-scoring candidates, ties to the earlier
index) against a literal sort of each row, on rows with ties, with room for every
candidate, one too many (a decoding step's single eviction) and many too many; and the
same selections on a layout that is not in position order (``pos`` given), as after
decoding steps filled evicted slots."""

import torch

from attnkit.kv.select import first, last, top


def literal_top(scores, candidates, count, pos=None):
    out = torch.zeros_like(candidates)
    order = torch.arange(scores.shape[-1]).expand(scores.shape) if pos is None else pos
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in scores.shape[:-1]]).view(-1, scores.dim() - 1).tolist():
        idx = tuple(idx)
        c = int(torch.as_tensor(count).expand(scores.shape[:-1])[idx])
        members = candidates[idx].nonzero().flatten().tolist()
        members.sort(key=lambda j: (-float(scores[idx][j]), int(order[idx][j])))
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


def literal_ends(valid, count, pos, earliest):
    out = torch.zeros_like(valid)
    for b in range(valid.shape[0]):
        for h in range(valid.shape[1]):
            members = sorted(valid[b, h].nonzero().flatten().tolist(), key=lambda j: int(pos[b, h, j]), reverse=not earliest)
            out[b, h, members[: int(count.expand(valid.shape[:2])[b, h])]] = True
    return out


def test_selections_by_position_on_a_shuffled_layout():
    g = torch.Generator().manual_seed(1)
    for trial in range(80):
        B, H, L = 2, 2, 11
        pos = torch.stack([torch.randperm(L, generator=g) for _ in range(B * H)]).view(B, H, L)
        valid = torch.rand(B, H, L, generator=g) > 0.25
        n = valid.sum(-1)
        kind = trial % 4  # one count for all, a handful, all but one (a decoding step), per-head counts
        count = (
            torch.tensor(3)
            if kind == 0
            else torch.clamp(n - 1, min=0)
            if kind == 2
            else torch.randint(0, L + 2, (B, H), generator=g)
            if kind == 3
            else torch.tensor(1)
        )
        for earliest, fn in ((True, first), (False, last)):
            assert torch.equal(fn(valid, count, pos), literal_ends(valid, torch.as_tensor(count), pos, earliest)), (
                trial,
                earliest,
            )
        scores = torch.randint(0, 3, (B, H, L), generator=g).double()
        assert torch.equal(top(scores, valid, count, pos), literal_top(scores, valid, count, pos)), trial
