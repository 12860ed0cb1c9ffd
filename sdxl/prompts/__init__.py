"""Prompts as AUTOMATIC1111 reads them: syntax, chunks and weights, tokens for the encoders, styles."""
