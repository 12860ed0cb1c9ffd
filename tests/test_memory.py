"""The fit check (`sdxl.engine.memory`): the compiled programs' bytes against a device's memory, and the
sentence that names what fits. The CPU reports no memory, so the device's is given here."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from sdxl.engine import memory
from sdxl.engine.hires import Hires
from sdxl.engine.pipeline import Pipeline
from sdxl.engine.request import Request


@pytest.fixture(scope="module")
def pipe():
    return Pipeline.from_pretrained("tiny", dtype="float32")


def _batches(pipe):
    request = Request.from_prompt("a fox", num_images=1, height=64, width=64, steps=2)
    return lambda n: pipe.programs_for(request, n * pipe.num_devices)


def test_what_a_program_holds_beside_the_weights_is_the_inputs_it_reads_its_outputs_and_temporaries():
    """An input the program never reads (a stage's, say the VAE's weights in `denoise`) has no buffer in it."""
    program = jax.jit(lambda weights, unread, x, y: jnp.tanh(weights @ x) + y)
    compiled = program.lower(*(jax.ShapeDtypeStruct(shape, jnp.float32) for shape in [(64, 64), (1000,), (64, 8), ()])
                             ).compile()
    held = compiled.memory_analysis()
    expected = (64 * 8 + 1) * 4 + held.output_size_in_bytes + held.temp_size_in_bytes - held.alias_size_in_bytes
    assert memory.bytes_beside_weights(compiled) == expected


@pytest.mark.compiles
def test_bigger_batches_need_more_and_the_check_names_the_largest_that_fits(pipe, monkeypatch):
    batches = _batches(pipe)
    in_use = 10_000_000  # weights "loaded" beside the program's own
    one, two = (memory.bytes_needed(pipe, batches(n), in_use) for n in (1, 2))
    assert in_use < one < two, "a program's activations grow with its batch"
    limit = (one + two) // 2
    monkeypatch.setattr(memory, "device_memory", lambda pipe: (limit, in_use))
    option = "--max-images-per-core {}".format
    memory.check_fits(pipe, batches, 1, option)  # fits: no error
    with pytest.raises(memory.DoesNotFitError, match=r"^--max-images-per-core 2 needs [\d.]+ GiB on each cpu, "
                       r"which holds [\d.]+ GiB; 1 per device fits: --max-images-per-core 1$"):
        memory.check_fits(pipe, batches, 2, option)
    monkeypatch.setattr(memory, "device_memory", lambda pipe: (in_use, in_use))
    with pytest.raises(memory.DoesNotFitError, match="not even 1 per device fits"):
        memory.check_fits(pipe, batches, 2, option)


def test_a_compiler_that_runs_out_of_memory_is_a_batch_that_does_not_fit(pipe, monkeypatch):
    import jax

    def refuse(program, stage):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")

    monkeypatch.setattr(pipe.executables, "compiled", refuse)
    assert memory.bytes_needed(pipe, _batches(pipe)(1), 0) is None
    monkeypatch.setattr(memory, "device_memory", lambda pipe: (2**34, 0))
    with pytest.raises(memory.DoesNotFitError, match="needs more than the compiler could place"):
        memory.check_fits(pipe, _batches(pipe), 1, "--num-images {}".format)


def test_devices_that_report_no_memory_are_not_checked(pipe):
    assert memory.device_memory(pipe) is None  # the CPU's
    memory.check_fits(pipe, lambda n: pytest.fail("nothing compiles for a check that cannot be made"), 64, str)


@pytest.mark.compiles
def test_with_a_refiner_that_leaves_no_room_the_check_says_what_fits_without_it(monkeypatch):
    """One image per device and the programs whole (the test above checks the staged ones and the count
    down to what fits): three compiles, the model's, the model's up to the handoff, the refiner's."""
    base = Pipeline.from_pretrained("tiny", dtype="float32")
    base.set_refiner(Pipeline.from_pretrained("tiny-refiner", dtype="float32"))
    weights = memory.refiner_bytes(base)
    assert weights > 0 and weights == sum(a.nbytes for a in jax.tree.leaves(base.refiner.params))  # nothing shared
    request = Request.from_prompt("a fox", num_images=1, height=64, width=64, steps=2)
    refined = dataclasses.replace(request, refine_from=0.8)
    batches = lambda n: [p for r in (request, refined) for p in base.programs_for(r, n * base.num_devices)]  # noqa: E731
    in_use = 10_000_000 + weights
    alone = memory.bytes_needed(base, [p for p in batches(1) if p.spec == base.spec], in_use - weights, progress=False)
    limit = alone + weights // 2  # room for the model's programs, not for the refiner's weights too
    monkeypatch.setattr(memory, "device_memory", lambda pipe: (limit, in_use))
    with pytest.raises(memory.DoesNotFitError, match=r"^--max-images-per-core 1 needs [\d.]+ GiB on each cpu, which "
                       r"holds [\d.]+ GiB; not even 1 per device fits beside the refiner's [\d.]+ GiB; "
                       r"without --refiner, 1 per device fits: --max-images-per-core 1$"):
        memory.check_fits(base, batches, 1, "--max-images-per-core {}".format, progress=False)


@pytest.mark.compiles
def test_a_hires_fix_is_checked_with_its_second_pass_and_the_check_says_what_fits_without_it(pipe, monkeypatch):
    """The CLI checks a request's programs (`PreparedRequest.programs_at`), a hires fix's second pass among
    them; where that pass leaves no room for 1 image per device, the sentence names what fits without it."""
    request = Request.from_prompt("a fox", num_images=1, height=64, width=64, steps=2)
    prepared = pipe.prepare(dataclasses.replace(request, hires=Hires(scale=2.0)))
    batches = lambda n: prepared.programs_at(pipe.padded_batch(n * pipe.num_devices))  # noqa: E731
    assert [(p.width, p.height) for p in batches(1)] == [(64, 64), (128, 128)]
    in_use = 10_000_000
    first_pass, with_hires = (memory.bytes_needed(pipe, programs, in_use, progress=False)
                              for programs in (batches(1)[:1], batches(1)))
    assert first_pass < with_hires, "the second pass, at 4x the pixels, needs more"
    monkeypatch.setattr(memory, "device_memory", lambda pipe: ((first_pass + with_hires) // 2, in_use))
    with pytest.raises(memory.DoesNotFitError, match=r"^--num-images 1 needs [\d.]+ GiB on each cpu, which holds "
                       r"[\d.]+ GiB; not even 1 per device fits with the hires fix's 128x128 pass \(a smaller upscale "
                       r"may\); without it, 1 per device fits: --num-images 1$"):
        memory.check_fits(pipe, batches, 1, "--num-images {}".format, progress=False)
