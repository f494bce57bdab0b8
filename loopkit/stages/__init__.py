"""The five stages of a run, one file each. See `loopkit/loop.py` for the order they run in."""
