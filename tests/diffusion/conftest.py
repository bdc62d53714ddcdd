import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # for `import diffusion_tiny`, `import diffusion_reference`

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pipeline():
    """(pipeline, call kwargs) of ``diffusion_tiny.pipeline()``, built once per session;
    tests must leave it as they found it (``use`` and the guidance wrappers restore it)."""
    import diffusion_tiny

    return diffusion_tiny.pipeline()
