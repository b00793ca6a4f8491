"""`python -m verl_dppo.cli` = `verl-dppo`."""

import sys

from verl_dppo.cli import main

sys.exit(main())
