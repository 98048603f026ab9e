"""The training machinery: the trainer (flags and recipe, the run directory, the loop), data,
checkpoints, optimizers, data parallelism and recorded (CUDA-graph) steps."""
