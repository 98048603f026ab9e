"""The study core: layers with hand-written forward and backward passes (convolutions, squash, the
three routing algorithms, capsule layers, losses), how they compose into networks (network.py,
architecture.py), and the three built-in networks (model.py).  Nothing here trains or writes files."""
