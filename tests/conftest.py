import os
import sys

# the tests import their shared helpers (harness, problems) as top-level modules
sys.path.insert(0, os.path.dirname(__file__))
