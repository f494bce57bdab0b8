"""`python -m benchmarks.ladder`: the ladder benchmark alone (benchmarks/bench_ladder.py explains it).

    python -m benchmarks.ladder                  # full size: two rounds, about 10-15 minutes on 2 cores
    python -m benchmarks.ladder --quick          # one round, fewer reviews
    python -m benchmarks.ladder --out /tmp/ladder

The same as `python -m benchmarks --only ladder [options]`: results.md, results.json and ladder.png go to
benchmarks/local-results/ unless --out says otherwise.
"""

import sys

from .__main__ import main

if __name__ == "__main__":
    sys.exit(main(["--only", "ladder", *sys.argv[1:]]))
