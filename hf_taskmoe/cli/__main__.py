"""`python -m hf_taskmoe.cli ...`: the `hf-taskmoe` console command without the installed entry point."""

import sys

from .console import main

sys.exit(main())
