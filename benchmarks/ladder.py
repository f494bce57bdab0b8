"""`python -m benchmarks.ladder`: the ladder benchmark alone (benchmarks/bench_ladder.py explains it).

    python -m benchmarks.ladder                  # full size: two rounds, inductor for the compiled rungs
    python -m benchmarks.ladder --quick          # one round, fewer reviews, compiled rungs on dynamo's eager backend
    python -m benchmarks.ladder --out /tmp/ladder

The same as `python -m benchmarks --only ladder [options]` (the Rotten Tomatoes reviews; `--only ladder_debates` is
the same ladder on the debates' statements): results.md, results.json and ladder.png go to
benchmarks/local-results/ unless --out says otherwise. How long a run takes: benchmarks/README.md.
"""

import sys

from .__main__ import main

if __name__ == "__main__":
    sys.exit(main(["--only", "ladder", *sys.argv[1:]]))
