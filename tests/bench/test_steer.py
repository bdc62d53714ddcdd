"""The steer benchmark suite: its quick mode runs in seconds and gives the advertised rows,
its memory bodies are valid calls, and the eager baseline's arithmetic (no timing is
asserted: the machine is shared)."""

import torch

from attnkit.bench import steer as suite


def test_quick_mode_rows():
    steps = []
    rows = suite.run(quick=True, progress=steps.append)
    assert len(steps) == suite.STEPS
    cases = [r.case for r in rows]
    assert cases == [
        "forward with emphasize",
        "forward with ablate",
        "forward with temperature",
        "rerank 20 documents, icr",
        "rerank 20 documents, sorting",
        "rerank 20 documents, basin",
    ]
    for r in rows:
        assert r.suite == "steer" and r.attnkit_ms > 0 and r.baseline_ms > 0
    for r in rows[:3]:
        assert r.size == "N=256" and r.ok == (r.ratio <= suite.TARGET_FORWARD)
    icr = rows[3]
    assert icr.ok == (icr.ratio <= suite.TARGET_RERANK) and rows[4].ok is None and rows[5].ok is None


def test_documents_are_about_the_asked_length():
    pm = suite.subject()
    docs = suite.documents(pm, 30)
    assert len(docs) == suite.DOCUMENTS
    for doc in docs:
        n = len(pm.tokenizer(doc, add_special_tokens=False)["input_ids"])
        assert 30 <= n < 30 + 40  # whole sentences are added until the length is reached


def test_memory_bodies_are_valid_calls():
    # what the subprocesses run, run here at a small size
    for body in suite.BODIES.values():
        namespace = {"pm": suite.subject(), "documents": suite.documents, "torch": torch}
        exec(body.format(n=200), namespace)


def test_the_eager_baseline_is_L_H_N2_floats():
    from attnkit.bench.probes import eager_weights_gib

    assert eager_weights_gib(16384) == 2 * 4 * 16384**2 * 4 / 2**30 == 8.0  # what the note reports at 16k
