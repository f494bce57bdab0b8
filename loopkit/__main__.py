"""`python -m loopkit report RUN_DIR`: rebuild a run's report (see loopkit/report.py)."""

import sys

from .report import main

sys.exit(main())
