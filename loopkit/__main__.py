"""`python -m loopkit report RUN_DIR [--force]`: print a run's report and draw its charts, rebuilt from its newest
checkpoint when the run's own report does not cover it (see loopkit/report.py)."""

import sys

from .report import main

sys.exit(main())
