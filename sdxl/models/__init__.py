"""The Flax models, one file each, their module names the checkpoints' keys; the blocks they share."""
