import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # for `import helpers_sweeps` (here and in the sweeps' worker processes)
