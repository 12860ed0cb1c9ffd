"""A request's sampling method: a sampler, by name, on a schedule type.

Two families share one loop (`samplers.Sampler`):

- diffusers' schedulers (`samplers.SAMPLERS`), reproduced step for step, on the schedule type
  "diffusers": the checkpoint's scheduler config decides the timesteps, as diffusers' pipelines do.
- AUTOMATIC1111's k-diffusion samplers (`kdiffusion.SAMPLERS`), on one of A1111's schedule types
  ("Automatic", "Karras", ...): what a pasted A1111 or Forge infotext ran.

Euler, Euler a and DPM++ 2M are in both; the schedule type picks which. A request that names no
schedule type gets the diffusers one where the sampler has it, else "Automatic" (`schedule_type_for`).
Only the family is a compiled program's choice (its step function); the schedule type is the
schedule's values, an input like the step count.
"""

from . import kdiffusion
from .samplers import SAMPLERS, Sampler
from .schedulers import Schedule, SchedulerConfig

DIFFUSERS = "diffusers"  # the schedule type of diffusers' samplers: the checkpoint's scheduler's timesteps
SCHEDULE_TYPES = (DIFFUSERS, *kdiffusion.SCHEDULE_TYPES)

# Every sampler by its name here and its label, the name A1111-style UIs and PNG "parameters" give
# it: diffusers' (`samplers.SAMPLERS`), then the rest of A1111's k-diffusion table, named after
# k-diffusion's functions.
SAMPLER_NAMES = {
    "euler": "Euler",
    "euler_ancestral": "Euler a",
    "dpmpp_2m": "DPM++ 2M",
    "dpmpp_2m_karras": "DPM++ 2M Karras",
    "ddim": "DDIM",
    "pndm": "PLMS",
    "lcm": "LCM",
    "tcd": "TCD",
    "heun": "Heun",
    "dpm_2": "DPM2",
    "dpm_2_ancestral": "DPM2 a",
    "lms": "LMS",
    "dpmpp_2s_ancestral": "DPM++ 2S a",
    "dpmpp_sde": "DPM++ SDE",
    "dpmpp_2m_sde": "DPM++ 2M SDE",
    "dpmpp_2m_sde_heun": "DPM++ 2M SDE Heun",
    "dpmpp_3m_sde": "DPM++ 3M SDE",
    "restart": "Restart",
}
# The samplers on each family's schedules: diffusers' (the "diffusers" schedule type), and A1111's
# k-diffusion ones (its schedule types), by name.
ON_DIFFUSERS_SCHEDULE = tuple(SAMPLERS)
ON_A1111_SCHEDULES = tuple(name for name, label in SAMPLER_NAMES.items() if label in kdiffusion.SAMPLERS)


def sampler_name(value) -> str:
    """A sampler's name here, from it or its label ("DPM++ 2M SDE"), in any case.

    Raises:
      ValueError: naming each sampler by name and label.
    """
    by_label = {label.lower(): name for name, label in SAMPLER_NAMES.items()}
    name = by_label.get(value.lower(), value.lower()) if isinstance(value, str) else value
    if name not in SAMPLER_NAMES:
        choices = ", ".join(f"{name} ({label})" for name, label in SAMPLER_NAMES.items())
        raise ValueError(f"unknown sampler {value!r}; choose one of: {choices}")
    return name


def schedule_type_named(value) -> str:
    """A schedule type of `SCHEDULE_TYPES` from its name in any case.

    Raises:
      ValueError: naming the schedule types.
    """
    by_lower = {name.lower(): name for name in SCHEDULE_TYPES}
    if not isinstance(value, str) or value.lower() not in by_lower:
        raise ValueError(f"unknown schedule type {value!r}; choose one of: {', '.join(SCHEDULE_TYPES)}")
    return by_lower[value.lower()]


def schedule_type_for(sampler: str, schedule_type: str | None) -> str:
    """The schedule type `sampler` (a name here) runs on: `schedule_type`, checked, or for None the
    sampler's own: diffusers' where it has it, else "Automatic".

    Raises:
      ValueError: an unknown schedule type, or one the sampler does not run on, in one sentence.
    """
    if schedule_type is None:
        return DIFFUSERS if sampler in ON_DIFFUSERS_SCHEDULE else "Automatic"
    schedule_type, label = schedule_type_named(schedule_type), SAMPLER_NAMES[sampler]
    if schedule_type == DIFFUSERS and sampler not in ON_DIFFUSERS_SCHEDULE:
        raise ValueError(f"{label} is one of A1111's samplers, not diffusers': give it one of A1111's schedule "
                         f"types ({', '.join(kdiffusion.SCHEDULE_TYPES)})")
    if schedule_type != DIFFUSERS and sampler not in ON_A1111_SCHEDULES:
        other = " (for A1111's, choose DPM++ 2M with the Karras schedule type)" if sampler == "dpmpp_2m_karras" else ""
        raise ValueError(f"{label} runs on diffusers' schedule only, not on the {schedule_type} schedule type{other}")
    return schedule_type


def loop(sampler: str, a1111: bool) -> Sampler:
    """The loop of `sampler` (a name here): k-diffusion's as A1111 runs it (on one of A1111's
    schedule types), or diffusers'. Schedules come from `schedule`, which takes the schedule type."""
    if a1111:
        return kdiffusion.sampler(SAMPLER_NAMES[sampler])
    return SAMPLERS[sampler]


def schedule(
    config: SchedulerConfig, sampler: str, schedule_type: str, steps: int, max_steps: int, *, is_sdxl: bool
) -> Schedule:
    """The schedule of `steps` asked for `sampler` on a resolved `schedule_type` (`schedule_type_for`),
    padded to max_steps; it holds the steps it runs (`Schedule.num_steps`: `steps_run(...)`).

    Raises:
      ValueError: the schedule does not fit max_steps, or A1111's Restart finds no restart in it.
    """
    if schedule_type == DIFFUSERS:
        return SAMPLERS[sampler].schedule(config, steps, max_steps)
    return kdiffusion.kdiffusion_schedule(config, schedule_type, SAMPLER_NAMES[sampler], steps, max_steps,
                                          is_sdxl=is_sdxl)


def steps_run(config: SchedulerConfig, sampler: str, schedule_type: str, steps: int, *, is_sdxl: bool) -> int:
    """The steps a schedule of `steps` asked runs: `steps`, but for A1111's DDIM schedule type, which
    may run one more (`schedule_types.ddim`)."""
    if schedule_type == DIFFUSERS:
        return steps
    return kdiffusion.schedule_steps(config, schedule_type, SAMPLER_NAMES[sampler], steps, is_sdxl=is_sdxl)
