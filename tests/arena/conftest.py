import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """The arena's models are tiny: one intra-op thread is fastest, and on a busy machine
    a second one makes every small op wait on it (measured 100x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
