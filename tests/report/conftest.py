import os
import sys

here = os.path.dirname(__file__)
sys.path.insert(0, here)  # for `import report_profiles`
sys.path.insert(0, os.path.join(here, "..", "inspect"))  # for `import inspect_models`
