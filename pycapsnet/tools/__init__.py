"""The tools around the core: the command line, finite-difference gradient checks, the autograd
oracle (reference.py), the memory planner and the pictures."""
