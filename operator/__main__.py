"""`python -m cpuserve.operator [crd] [--namespace NS] [--standalone]`."""
import sys

from cpuserve.operator.cli import main

sys.exit(main())
