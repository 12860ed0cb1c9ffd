"""A request as the devices take it: `PreparedRequest`, made once by `sdxl.engine.preparing.prepare`, and
the `Plan` of its run.

Preparing is all the host's work before a request can be queued: its values checked against the
loaded model (`Request.validated`), its prompts tokenized, the programs it runs named and its run
planned (`planned`: the schedule, which holds its length, and the steps of it that run). It is done
where the request is submitted (the demo's check, the CLI, `generate`), so the device queue, a
runner for several hosts and `Pipeline.render` take it as it is, with the loaded model it was prepared
against. Requests the queue merges are prepared ones merged (`PreparedRequest.merged`): nothing is
checked, tokenized or planned twice.
"""

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from ..prompts.tokens import Tokens
from ..sampling import methods
from ..sampling.schedulers import Schedule
from .program import GenerateProgram
from .request import Request


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """What a program's run steps through, resolved once where its request is prepared
    (`sdxl.engine.preparing`): the sampler's schedule on the request's schedule type, which holds its own
    length, and the stretch of it that runs."""

    schedule: Schedule  # padded to the program's `max_steps`; `schedule.num_steps` steps in it
    first: int  # its steps first..stop-1 run: a strength or a refiner's handoff skips the first ones,
    stop: int  # a base model's handoff stops early, a hires pass runs a schedule's last steps

    @property
    def length(self) -> int:
        """The steps the schedule holds: the request's, but for A1111's DDIM type, which may hold one more."""
        return int(self.schedule.num_steps)

    @property
    def steps_run(self) -> int:
        return self.stop - self.first


def planned(program: GenerateProgram, request: Request, first_step: int | None = None) -> Plan:
    """The plan of a validated request's run: its sampler's schedule on its schedule type, padded to the
    program's `max_steps`, and the steps of it that run, as diffusers picks them (`first_step` given: from
    there to the end, a hires pass's). A strength skips the first steps (`get_timesteps`),
    `denoising_start` the steps at or above its timestep cutoff, and `denoising_end` stops before the
    steps below its own. (On A1111's schedule types a request runs whole: `Request.validated`.)

    Raises:
      ValueError: no step is left to run.
    """
    schedule = padded_schedule(program.spec, request.sampler, request.schedule_type, request.steps,
                               program.max_steps)
    steps = int(schedule.num_steps)
    if first_step is not None:
        return Plan(schedule, first_step, steps)
    timesteps = np.asarray(schedule.timesteps)[:steps]
    train_steps = program.spec.scheduler.num_train_timesteps

    def cutoff(fraction: float) -> int:
        return int(round(train_steps - fraction * train_steps))

    first, stop = 0, steps
    if request.start_from == "image":
        first = steps - min(int(steps * request.strength), steps)
    elif request.denoising_start is not None:
        first = steps - int((timesteps < cutoff(request.denoising_start)).sum())
    if request.denoising_end is not None:
        stop = first + int((timesteps[first:] >= cutoff(request.denoising_end)).sum())
    if stop <= first:
        raise ValueError(
            f"denoising_start {request.denoising_start} and denoising_end {request.denoising_end} leave none of "
            f"the {steps} steps to run; move them apart or add steps"
        )
    return Plan(schedule, first, stop)


@functools.lru_cache(maxsize=256)
def padded_schedule(spec, sampler: str, schedule_type: str, steps: int, max_steps: int) -> Schedule:
    """The noise schedule of a sampler, schedule type and step count, padded to `max_steps`; each made once."""
    return methods.schedule(spec.scheduler, sampler, schedule_type, steps, max_steps, is_sdxl=spec.is_sdxl)


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedRequest:
    """A validated request, its prompts' tokens, the program that renders it, the plan of its run and
    the loaded model it renders with; with a refiner's handoff, the refiner's part, which continues its
    latents; with a hires fix, the second pass, from its upscaled result."""

    request: Request  # validated (`Request.validated`); with a refiner's handoff, the whole request
    tokens: Tokens  # its prompts as this model's encoders read them
    program: GenerateProgram  # at this request's batch (its image count, padded to the devices)
    plan: Plan  # its schedule and the steps of it that run
    # The snapshot it was prepared against (`sdxl.engine.model.LoadedModel`), which renders it whatever is
    # loaded meanwhile; None only where a process must attach its own, loaded alike (`with_model`).
    model: object = dataclasses.field(default=None, repr=False)
    refined: "PreparedRequest | None" = None  # with `refine_from`: the refiner's part, from the latents this one leaves
    hires: "PreparedRequest | None" = None  # with `Request.hires`: the second pass (its start filled when it renders)

    def __len__(self) -> int:
        return len(self.request)

    @property
    def steps(self) -> tuple[int, int]:
        """The steps first..stop-1 of its schedule that run."""
        return self.plan.first, self.plan.stop

    def with_model(self, model, refiner=None) -> "PreparedRequest":
        """This request rendering with `model` (its refiner's part with `refiner`): for another process,
        which receives a prepared request without the snapshot (`sdxl.serving.hosts`) and renders it with
        its own, loaded alike. None detaches them."""
        parts = {name: None if getattr(self, name) is None else getattr(self, name).with_model(
            refiner if name == "refined" else model) for name in ("refined", "hires")}
        return dataclasses.replace(self, model=model, **parts)

    @property
    def programs(self) -> tuple[GenerateProgram, ...]:
        """What rendering it runs, in order: its program, then the refiner's or the hires pass's."""
        return (self.program, *(program for part in self.continued_by for program in part.programs))

    @property
    def continued_by(self) -> tuple["PreparedRequest", ...]:
        """The parts that render after its program: the refiner's or the hires pass (they do not combine)."""
        return tuple(part for part in (self.refined, self.hires) if part is not None)

    @property
    def steps_run(self) -> int:
        """The denoising steps it runs, the refiner's or the hires pass's included: what progress counts to."""
        return self.plan.steps_run + sum(part.steps_run for part in self.continued_by)

    @property
    def batch_key(self) -> tuple:
        """Requests with equal keys share a call in the device queue: equal `call_settings`, all needing
        guidance or none (a request without would otherwise pay for the other's second UNet pass),
        prompts of as many chunks (a short one would pay for the other's long context) and as many
        conditionings (a prompt without edits would pay for the other's texts), of textual-inversion
        vectors all or none (a prompt without keeps the programs compiled for it), and prepared against
        the same loaded model (which renders them all)."""
        return (self.request.call_settings, self.program.guided, self.tokens.num_chunks, self.tokens.num_conditionings,
                self.program.embedding_rows, self.model)

    def programs_at(self, batch: int) -> tuple[GenerateProgram, ...]:
        """Its programs at another (padded) batch size: what a merged batch of requests like it runs."""
        return tuple(dataclasses.replace(program, batch=batch) for program in self.programs)

    @classmethod
    def merged(cls, parts: Sequence["PreparedRequest"], batch: int) -> "PreparedRequest":
        """One prepared request for the images of several with the same `call_settings`, in order,
        rendered at `batch` (their image count, padded to the devices). Its program guides if any
        part needs guidance, reads the longest part's chunks and the most conditionings, and the
        textual-inversion vectors where a part reads them (a grid's cells merge without `batch_key`)."""
        first = parts[0]
        program = dataclasses.replace(
            first.program, batch=batch, guided=any(p.program.guided for p in parts),
            chunks=max(p.program.chunks for p in parts), conditionings=max(p.program.conditionings for p in parts),
            embedding_rows=max(p.program.embedding_rows for p in parts),
        )
        refined, hires = (None if getattr(first, name) is None else cls.merged([getattr(p, name) for p in parts], batch)
                          for name in ("refined", "hires"))
        return cls(Request.merged([p.request for p in parts]), Tokens.merged([p.tokens for p in parts]), program,
                   first.plan, first.model, refined, hires)
