"""The probes benchmark suite: its subject, the eager baseline's arithmetic and failure
under the address cap, and a needle grid cell timed against a plain generate of the
same prompt (no timing is asserted: the machine is shared)."""

import pytest

from attnkit.bench import probes as suite


@pytest.mark.slow  # one subprocess (about 15 s of CPU: transformers' eager path builds a 4 GiB mask first)
def test_the_eager_baseline_needs_L_H_N2_floats_and_cannot_allocate_32k_under_the_cap():
    # 2 layers x 4 heads x 32768^2 float32 = 32 GiB, 8k: 2 GiB
    assert suite.eager_weights_gib(32768) == 2 * 4 * 32768**2 * 4 / 2**30 == 32.0
    assert suite.eager_weights_gib(8192) == 2.0
    row = suite.eager_case(32768)  # one layer's scores alone are 16 GiB: refused at once under 8 GiB
    assert row.attnkit_ms is None and row.extra == {"ran": False}
    assert row.note.startswith("could not run: ") and "needs 32.00 GiB of weights" in row.note


def test_short_error_keeps_the_size_torch_tried_to_allocate():
    message = (
        "RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: "
        "you tried to allocate 17179869184 bytes."
    )
    assert suite._short_error(message) == "can't allocate 16.0 GiB"
    assert suite._short_error("x" * 300) == "x" * 160


def test_subject_reads_natural_language_and_has_the_advertised_shape():
    pm = suite.tiny_probe_model()
    config = pm.model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.hidden_size) == (
        suite.LAYERS,
        suite.HEADS,
        suite.KV_HEADS,
        suite.D_MODEL,
    )
    assert pm.kind == "causal" and pm.max_positions == 65536 and pm.tokenizer.eos_token_id is None
    ids = suite._needle_prompt(pm, 300)
    assert len(ids) == 300  # the needle probe's own prompt, exactly N tokens
    assert "special code" in pm.tokenizer.decode(ids)


def test_needle_cell_row():
    row, bare = suite.needle_cell_case(256, repeats=1)
    assert bare.size == "N=256" and bare.ok is None and bare.attnkit_ms > 0
    assert row.suite == "probes" and row.size == "N=256" and row.baseline == "plain generate, sdpa"
    assert row.attnkit_ms > 0 and row.baseline_ms > 0 and row.ok == (row.ratio <= suite.TARGET_TIME)


@pytest.mark.parametrize("probe", sorted(suite.BODIES))
def test_memory_bodies_call_the_probes_with_their_own_keywords(probe):
    # what the subprocess runs, run here at a small size: it must be a valid probe call
    pm = suite.tiny_probe_model()
    namespace = {"pm": pm}
    exec(suite.BODIES[probe].format(n=128, new=suite.NEW_TOKENS), namespace)
