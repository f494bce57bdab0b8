"""`python -m loopkit report RUN_DIR [--force]`: print a run's report and draw its charts, rebuilt from its newest
checkpoint when the run's own report does not cover it (see loopkit/report/).
`python -m loopkit convert-dcp SRC DST [--checkpoint]`: a DCPStorage checkpoint as a `save_pretrained` folder or an
HF-layout checkpoint (see loopkit/storage/dcp.py).
`python -m loopkit torchrun [torchrun's arguments]`: torchrun for elastic restarts and preemption (see
loopkit/distributed.py's `torchrun`)."""

import sys

if sys.argv[1:2] == ["convert-dcp"]:
    from .storage.dcp import main as convert_main

    sys.exit(convert_main(sys.argv[2:]))

if sys.argv[1:2] == ["torchrun"]:
    from .distributed import torchrun

    sys.exit(torchrun(sys.argv[2:]))

from .report.cli import main  # noqa: E402

sys.exit(main())
