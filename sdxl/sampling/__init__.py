"""Noise schedules and samplers: pure functions over a denoiser and a sigma schedule."""
