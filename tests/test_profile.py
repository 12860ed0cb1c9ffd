"""The profile's summary: HLO ops read off a compiled program, sorted into kinds of work and parts of the model,
and their device time read back from a jax.profiler trace (on the CPU, the XLA thunks' events)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdxl.bench import profile


def _model(x, kernel, weight):
    """A conv, a norm and a matmul in a loop, as a UNet step, then a decode-like conv after it."""
    def step(i, x):
        with jax.named_scope("UNet2DConditionModel"):
            y = jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
            with jax.named_scope("norm1"):
                y = (y - y.mean((1, 2), keepdims=True)) * jax.lax.rsqrt(y.var((1, 2), keepdims=True) + 1e-5)
            return jnp.tanh(y @ weight)

    x = jax.lax.fori_loop(0, jnp.int32(x.shape[0]), step, x)  # a traced trip count, as the pipeline's
    with jax.named_scope("AutoencoderKL.decode"):
        return jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    rng = np.random.default_rng(0)
    args = (rng.standard_normal((3, 64, 64, 32), np.float32), rng.standard_normal((3, 3, 32, 32), np.float32) / 17,
            rng.standard_normal((32, 32), np.float32) / 6)
    compiled = jax.jit(_model).lower(*args).compile()
    compiled(*args).block_until_ready()
    xplane = profile.trace(lambda: compiled(*args).block_until_ready(), tmp_path_factory.mktemp("trace"))
    return xplane, compiled.as_text()


def test_the_steps_ops_are_sorted_by_kind_and_part(traced):
    xplane, hlo_text = traced
    summary = profile.summarise(xplane, hlo_text, steps=3, top=100)
    by_kind = {(row["category"], row["part"]) for row in summary["top"]}
    assert {("convolution", profile.STEP), ("gemm", profile.STEP), ("convolution", "VAE decode")} <= by_kind
    assert ("groupnorm/reduction", profile.STEP) in by_kind
    # The loop's own event holds its body's: counted less those, it is not the top op.
    assert not summary["top"][0]["op"].startswith("while")
    assert summary["step_ms"] > 0 and summary["parts"]["VAE decode"] > 0
    assert np.isclose(sum(summary["step_categories"].values()), summary["step_ms"])
    assert 0 < summary["busy"] <= 1
    table = profile.markdown(summary, "a test")
    assert table.startswith("## a test\n") and "| convolution |" in table


def test_a_saved_trace_is_summarised_again_even_where_it_names_the_program_otherwise(traced):
    """What a lease brings back (the trace and the HLO text beside it) summarised without the device; a
    trace whose events name another module still counts (rather than no op at all)."""
    xplane, hlo_text = traced
    directory = xplane.parents[3]
    (directory / profile.HLO_TEXT).write_text(re.sub(r"^HloModule \S+", "HloModule renamed,", hlo_text, flags=re.M))
    summary = profile.write_summary(directory, "again")
    assert summary["step_ms"] > 0 and (directory / "profile.md").read_text().startswith("## again\n")
    assert summary == profile.write_summary(directory, "again")


def test_an_ops_kind_comes_from_its_opcodes_targets_and_kernels():
    assert profile.category({"custom-call"}, "__cudnn$fmhasoftmax cudnn_generated_fort_native_sdpa", "") == "attention"
    assert profile.category({"dot", "fusion"}, "", "jit(whole)/xla_attention/dot_general") == "attention"
    assert profile.category({"custom-call"}, "__cudnn$convforward sm90_xmma_fprop_implicit_gemm", "") == "convolution"
    assert profile.category({"fusion", "dot", "parameter"}, "gemm_fusion_dot.3", "") == "gemm"
    assert profile.category({"custom-call"}, "__cublas$lt$matmul", "") == "gemm"
    assert profile.category({"fusion", "reduce", "multiply"}, "", "") == "groupnorm/reduction"
    assert profile.category({"fusion", "subtract", "multiply"}, "", "unet/norm1/mul") == "groupnorm/reduction"
    assert profile.category({"fusion", "transpose", "parameter"}, "", "") == "copy/transpose"
    assert profile.category({"fusion", "add", "parameter"}, "", "") == "elementwise fusion"


def test_nested_events_count_their_own_time_only():
    spans = [["while", "while", 0, 0, 100], ["a", "a", 0, 10, 30], ["b", "b", 0, 50, 20], ["c", "c", 0, 200, 5]]
    own = {op: time for op, _, _, _, _, time in profile._self_times(spans)}
    assert own == {"while": 50, "a": 30, "b": 20, "c": 5}
